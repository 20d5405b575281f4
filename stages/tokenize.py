"""The tokenize stage: Megatron-LM's `tools/preprocess_data.py` as a cached, resumable stage.

    python -m stages.tokenize --input 'data/*.jsonl.zst' --json-keys text --append-eod \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --output-prefix out/corpus --workers 8

writes `out/corpus_text_document.bin/.idx` (`_sentence` with `--split-sentences`), byte for byte what
Megatron writes for the same token ids, documents in input order. The artifact (under `--store`) holds the
same files as `tokens_<key>_<level>.bin/.idx`; a second run with the same input and settings is a cache hit.

The parts: `stages/tokenize_params.py` (the settings), `stages/tokenize_inputs.py` (which files, cut into
work units), `stages/tokenize_worker.py` (one unit to a partial `.bin/.idx`, committed as a shard),
`stages/sentences.py` (`--split-sentences`), and this module: the stage, which runs the units through
`stages.shards` (a local process pool, or a flow's task runner), merges the partials in input order
(`add_index`; Megatron's `--partitions` would interleave documents) and removes them, and the command line.
A killed run, rerun, redoes only the missing units and writes the same bytes. Memory is bounded by the batch
size and the longest document, never by the input size.

Input decisions, where Megatron crashes or is silent:
- a line that is not JSON, or lacks a `--json-keys` key, or whose value is neither a string nor a list of
  strings (a list is taken as the document's sentences, as in Megatron) stops the run with the file, line
  and problem; `--skip-bad-records` drops the record and counts it (`skipped_bad_records`).
- invalid UTF-8 is decoded with U+FFFD replacement characters and counted (`invalid_utf8_lines`);
  blank lines are skipped (Megatron would fail on them).
- an empty text (or one that tokenizes to nothing) is kept as a document of zero sequences, exactly as
  Megatron's `add_document([], [])` does, and counted (`empty_documents`); EOD is not appended to it.
- an input with no documents at all gives an empty dataset and a warning; `--fail-on-empty` makes it an error.
- an `--output-prefix` that cannot be written is reported before anything is read.
- very long documents are tokenized whole (one sequence per document, or per sentence).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Sequence

import numpy as np
from fsspec.implementations.local import LocalFileSystem
from tqdm import tqdm

from megatron_train.legacy_flags import GIVEN, Renamed, add_legacy_flags
from megatron_train.tokenizer import TOKENIZER_TYPES
from stages.base import Inputs, Stage
from stages.shards import MapShards, process_pool, read_committed_json, run_shards, write_json
from stages.tokenize_inputs import WorkUnit, plan_units, resolve_inputs
from stages.tokenize_params import COUNTERS, PARTIALS_DIR, TokenizeParams
from stages.tokenize_worker import tokenize_unit
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter, StoreNotWritable
from storage.atomic import atomic_copy
from storage.indexed_dataset import IndexedDatasetBuilder, best_dtype, data_file_path, index_file_path
from storage.verify import ChangedArtifactError

log = logging.getLogger("megatron_flow.stage.tokenize")

MERGED_SHARD = "merged"
SUMMARY_FILE = "tokenize_summary.json"


class Throughput:
    """Megatron's `Processed N documents (x docs/s, y MB/s).` lines, every `log_interval` documents, as units
    finish (`on_result` of the shard runner)."""

    def __init__(self, log_interval: int):
        self.log_interval = max(1, log_interval)
        self.started = time.time()
        self.documents = self.bytes = 0

    def __call__(self, stats: dict) -> None:
        before = self.documents
        self.documents += stats["documents"]
        self.bytes += stats["bytes"]
        if self.documents // self.log_interval > before // self.log_interval:
            elapsed = max(time.time() - self.started, 1e-9)
            log.info(
                "Processed %d documents (%.1f docs/s, %.2f MB/s).",
                self.documents,
                self.documents / elapsed,
                self.bytes / elapsed / 2**20,
            )


def _partial_prefix(writer: ArtifactWriter, name: str) -> str:
    """A local path prefix of a committed partial `<name>.bin/.idx` (downloaded from a remote store)."""
    if isinstance(writer.fs, LocalFileSystem):
        return f"{writer.path}/{name}"
    local = os.path.join(writer.local_dir, "download", name)
    os.makedirs(os.path.dirname(local), exist_ok=True)
    for path in (data_file_path(name), index_file_path(name)):
        writer.fs.get_file(f"{writer.path}/{path}", os.path.join(writer.local_dir, "download", path))
    return local


def merge_units(
    writer: ArtifactWriter, units: list[WorkUnit], params: TokenizeParams, dtype: np.dtype
) -> None:
    """Concatenate the partials in input order into the final files, commit them, then drop the partials."""
    summary: dict = dict.fromkeys(COUNTERS, 0)
    for unit in units:
        for counter, value in read_committed_json(writer, f"{PARTIALS_DIR}/{unit.name}/stats.json").items():
            summary[counter] += value
    files = {}
    merge_dir = os.path.join(writer.local_dir, "merged")
    os.makedirs(merge_dir, exist_ok=True)
    for key in params.json_keys:
        name = params.output_name(key)
        prefix = os.path.join(merge_dir, name)
        builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
        for unit in tqdm(units, desc=f"merge {key}", unit="unit", disable=None):
            builder.add_index(_partial_prefix(writer, f"{PARTIALS_DIR}/{unit.name}/{name}"))
        builder.finalize(index_file_path(prefix))
        files[f"{name}.bin"], files[f"{name}.idx"] = data_file_path(prefix), index_file_path(prefix)
    summary["dtype"] = np.dtype(dtype).name
    files[SUMMARY_FILE] = write_json(summary, os.path.join(merge_dir, SUMMARY_FILE))
    writer.commit_shard(MERGED_SHARD, files)
    if writer.fs.exists(f"{writer.path}/{PARTIALS_DIR}"):
        writer.fs.rm(f"{writer.path}/{PARTIALS_DIR}", recursive=True)


class TokenizeStage(Stage):
    name = "tokenize"
    version = "1"
    libraries = ("tokenizers", "sentencepiece", "tiktoken", "transformers")
    Params = TokenizeParams
    maps_shards = True

    def key_params(self, params: TokenizeParams) -> dict:
        """Only what changes the output: more workers or other partitions give the same bytes."""
        return params.fingerprint_fields()

    def key_inputs(self, params: TokenizeParams, inputs: Inputs | str) -> list[ArtifactRef | str]:
        return resolve_inputs(inputs)[1]

    def run(
        self,
        params: TokenizeParams,
        inputs: Inputs | str,
        store: ArtifactStore,
        map_shards: MapShards | None = None,
    ) -> ArtifactRef:
        """Tokenize documents (artifacts of Parquet shards, files, globs or URLs; one or a list of them);
        `map_shards`: a pool of `params.workers` processes unless a flow passes its own."""
        if params.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(
                f"unknown --tokenizer-type {params.tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
            )
        if not params.json_keys:
            raise ValueError("--json-keys names no key: give at least one, e.g. --json-keys text")
        tokenizer = params.build_tokenizer()  # a bad tokenizer setting fails here, before any work
        if params.append_eod and tokenizer.eod is None:
            raise ValueError(
                f"--append-eod: the {params.tokenizer_type} tokenizer has no end-of-document token"
            )
        urls, _, storage_options = resolve_inputs(inputs)
        map_shards = map_shards or process_pool(params.workers)

        def build(writer: ArtifactWriter) -> dict:
            started = time.time()
            if not writer.has_shard(MERGED_SHARD):
                units = plan_units(urls, params, storage_options)
                args = [(writer, unit, params, storage_options) for unit in units]
                names = [unit.name for unit in units]
                run_shards(writer, tokenize_unit, args, names, map_shards, Throughput(params.log_interval))
                merge_units(writer, units, params, best_dtype(tokenizer.vocab_size))
            summary = read_committed_json(writer, SUMMARY_FILE)
            dtype = summary.pop("dtype")
            summary["seconds"] = round(time.time() - started, 3)
            log.info("tokenize summary: %s", ", ".join(f"{k} {v}" for k, v in summary.items()))
            return {
                "summary": summary,
                "dtype": dtype,
                "outputs": {key: params.output_name(key) for key in params.json_keys},
                "input_files": len(urls),
            }

        ref = self.build_artifact(params, inputs, store, build)
        if ref.manifest()["summary"]["documents"] == 0:
            problem = f"no documents in {', '.join(urls) or 'the input'}: the dataset {ref.url} is empty"
            if params.fail_on_empty:
                raise ValueError(f"{problem}; check --input and --json-keys (--fail-on-empty is set)")
            log.warning("%s; pass --fail-on-empty to make this an error", problem)
        return ref


STAGE = TokenizeStage()
run = STAGE.run
key = STAGE.key


# ---------------------------------------------------------------------------------------------------------
# Command line: Megatron's flags


def build_parser() -> argparse.ArgumentParser:
    """Megatron's tools/preprocess_data.py command line (and its older spellings)."""
    defaults = TokenizeParams()
    # Imported here: the flag definitions come with the training config (torch), which the stage does not need.
    from megatron_train.tokenizer.flags import add_tokenizer_args

    parser = argparse.ArgumentParser(prog="python -m stages.tokenize", description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument(
        "--input",
        required=True,
        help="a .jsonl/.json(.gz/.zst/.xz/.bz2) or .parquet file, glob or fsspec URL",
    )
    group.add_argument(
        "--json-keys", nargs="+", default=list(defaults.json_keys), help="keys to extract from each record"
    )
    group.add_argument("--split-sentences", action="store_true", help="split documents into sentences")
    group.add_argument(
        "--keep-newlines", action="store_true", help="keep newlines between sentences when splitting"
    )
    group.add_argument(
        "--skip-bad-records", action="store_true", help="count and skip bad records instead of stopping"
    )
    group.add_argument(
        "--fail-on-empty", action="store_true", help="an input with no documents is an error, not a warning"
    )
    add_tokenizer_args(parser)  # the one definition every entry point shares
    group.add_argument(
        "--append-eod", action="store_true", help="append an <eod> token to the end of a document"
    )
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", required=True, help="path of the output files without _<key>_<level>.bin"
    )
    group.add_argument("--store", default="./artifacts", help="artifact store URL (cache of stage outputs)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=defaults.workers, help="worker processes")
    group.add_argument(
        "--partitions",
        type=int,
        default=defaults.partitions,
        help="cut the input into about this many work units at least",
    )
    group.add_argument(
        "--shard-size-mb", type=float, default=defaults.shard_size_mb, help="maximum work unit size"
    )
    group.add_argument(
        "--log-interval",
        type=int,
        default=defaults.log_interval,
        help="documents between progress log lines",
    )
    parser.add_argument(
        "--dataset-impl",
        choices=["mmap"],
        help="Megatron's old .bin/.idx format choice; mmap, the only format written here, is accepted",
    )
    vocab = Renamed(
        "--vocab", "--vocab-file {}", {"vocab_file": GIVEN}, why="Megatron's README abbreviated it"
    )
    add_legacy_flags(parser, (vocab,))
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "tokenizer_type", None) is None:  # required, as in Megatron's preprocess_data.py
        parser.error(
            f"the following arguments are required: --tokenizer-type (one of {', '.join(TOKENIZER_TYPES)})"
        )
    return args


def params_from_args(args: argparse.Namespace) -> TokenizeParams:
    fields = {f.name for f in dataclasses.fields(TokenizeParams)}
    return TokenizeParams(**{name: value for name, value in vars(args).items() if name in fields})


def check_output_prefix(output_prefix: str) -> None:
    """Fail before any work when the output files cannot be written (not after tokenizing everything)."""
    directory = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"--output-prefix {output_prefix}: cannot create the folder {directory} ({err.strerror}); "
            "choose a writable path"
        ) from None
    if not os.access(directory, os.W_OK):
        raise ValueError(
            f"--output-prefix {output_prefix}: the folder {directory} is not writable; choose a writable path"
        )


def export(ref: ArtifactRef, params: TokenizeParams, output_prefix: str) -> list[str]:
    """Copy the artifact's files to `<output-prefix>_<key>_<level>.bin/.idx` (a copy, not a link: a later
    writer truncating the output must not corrupt the store); each file appears complete or not at all."""
    written = []
    for key in params.json_keys:
        for ext in ("bin", "idx"):
            dest = f"{output_prefix}_{key}_{params.level}.{ext}"
            atomic_copy(ref.local_path(f"{params.output_name(key)}.{ext}"), dest)
            written.append(dest)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    params = params_from_args(args)
    try:
        check_output_prefix(args.output_prefix)
        ref = run(params, args.input, ArtifactStore(args.store))
    except (FileNotFoundError, ValueError, StoreNotWritable, ChangedArtifactError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    summary = ref.manifest()["summary"]
    print(("cache hit: " if ref.cache_hit else "") + ref.url)
    print(
        f"{summary['documents']} documents, {summary['sentences']} sentences, {summary['tokens']} tokens, "
        f"{summary['bytes'] / 2**20:.2f} MB in {summary['seconds']:.1f} s; skipped {summary['skipped_bad_records']} "
        f"bad records, {summary['empty_documents']} empty documents, {summary['invalid_utf8_lines']} lines with invalid UTF-8"
    )
    for path in export(ref, params, args.output_prefix):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
