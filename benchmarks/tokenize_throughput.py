"""Tokenize throughput: `python -m stages.tokenize` (the real CLI: planning, JSON parsing, workers, commits,
merge, export) beside the bare `tokenizers.Tokenizer.encode_batch` of the same Rust tokenizer on the same
texts in as many processes, both one thread per process. Also the peak memory (RSS of the whole process
tree) of our run on the whole input and on half of it: it must not grow with the input. Our files must be
byte-identical to a `.bin/.idx` built from the bare `encode_batch` ids (GPT-2 files run on tiktoken in our
stage: `megatron_train/tokenizer/gpt2.py`).

    .venv/bin/python -m benchmarks.tokenize_throughput --mb 20 --workers 2 --repeats 3

Needs ../shared (GCIDE corpus, GPT-2 vocabulary). Ends with `ratio: <ours MB/s / bare MB/s>`.
"""

from __future__ import annotations

import argparse
import json
import lzma
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

# Run as a script, this file's folder comes first on sys.path and the file's name would shadow the standard
# library's `tokenize` (which linecache, inspect and the tokenizer's dependencies import): drop the folder.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

SHARED = os.environ.get("MEGATRON_FLOW_SHARED", os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
CORPUS = os.path.join(SHARED, "corpora", "gcide.jsonl.xz")
VOCAB = os.path.join(SHARED, "vocab", "gpt2-vocab.json")
MERGES = os.path.join(SHARED, "vocab", "gpt2-merges.txt")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SINGLE_THREAD = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}


def extract(path: str, megabytes: float) -> tuple[int, int]:
    """The first GCIDE records holding `megabytes` of text, as plain JSON Lines; (documents, text bytes)."""
    documents = text_bytes = 0
    with lzma.open(CORPUS, "rt", encoding="utf-8") as source, open(path, "w", encoding="utf-8") as out:
        for line in source:
            out.write(line)
            documents += 1
            text_bytes += len(json.loads(line)["text"].encode())
            if text_bytes >= megabytes * 2**20:
                break
    return documents, text_bytes


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, stack, page = 0, [root], os.sysconf("SC_PAGE_SIZE")
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
        stack.extend(children.get(pid, []))
    return total


def run_ours(input_path: str, workers: int, workdir: str) -> tuple[float, float, int, str]:
    """Wall seconds, CPU seconds (whole process tree), peak tree RSS and output prefix of one uncached CLI run."""
    store = tempfile.mkdtemp(dir=workdir, prefix="store-")
    command = [
        sys.executable, "-m", "stages.tokenize", "--input", input_path, "--json-keys", "text",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES, "--append-eod",
        "--workers", str(workers), "--store", store, "--output-prefix", os.path.join(store, "out"),
    ]  # fmt: skip
    cpu_before = _children_cpu()
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0

    def poll() -> None:
        nonlocal peak
        while process.poll() is None:
            peak = max(peak, tree_rss(process.pid))
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    _, stderr = process.communicate()
    seconds = time.perf_counter() - started
    poller.join()
    if process.returncode:
        raise RuntimeError(f"stages.tokenize failed:\n{stderr.decode()[-2000:]}")
    return seconds, _children_cpu() - cpu_before, peak, os.path.join(store, "out_text_document")


def _children_cpu() -> float:
    """CPU seconds of all reaped descendants (the CLI waits for its workers, so they count)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _bare_worker(input_path: str, rank: int, world: int, batch: int) -> tuple[float, float]:
    """Wall and CPU seconds this process spends in encode_batch on its share (every world-th record)."""
    from megatron_train.tokenizer import build_tokenizer

    # The very Rust tokenizer our stage uses (same model and settings): only the pipeline around it differs.
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES).backend
    with open(input_path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for i, line in enumerate(f) if i % world == rank]
    started, cpu_started = time.perf_counter(), time.process_time()
    for start in range(0, len(texts), batch):
        encodings = tokenizer.encode_batch(texts[start : start + batch], add_special_tokens=False)
        [encoding.ids for encoding in encodings]  # what any consumer reads
    return time.perf_counter() - started, time.process_time() - cpu_started


def bare_files(input_path: str, prefix: str) -> None:
    """`prefix.bin/.idx` from the bare `encode_batch` ids, each document followed by EOD (the reference)."""
    from megatron_train.tokenizer import build_tokenizer
    from storage.indexed_dataset import IndexedDatasetBuilder, best_dtype

    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=best_dtype(tokenizer.vocab_size))
    with open(input_path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    for start in range(0, len(texts), 512):
        for encoding in tokenizer.backend.encode_batch(texts[start : start + 512], add_special_tokens=False):
            if encoding.ids:
                builder.add_document([*encoding.ids, tokenizer.eod], [len(encoding.ids) + 1])
            else:
                builder.add_document([], [])
    builder.finalize(prefix + ".idx")


def same_bytes(a: str, b: str) -> bool:
    with open(a, "rb") as first, open(b, "rb") as second:
        return first.read() == second.read()


def run_bare(input_path: str, workers: int) -> tuple[float, float]:
    """Wall seconds until the slowest of `workers` processes has encoded its share, and their CPU seconds
    (loading the texts and the tokenizer excluded)."""
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.starmap(_bare_worker, [(input_path, r, workers, 512) for r in range(workers)])
    return max(wall for wall, _ in results), sum(cpu for _, cpu in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=20.0, help="megabytes of GCIDE text to tokenize")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not all(os.path.isfile(p) for p in (CORPUS, VOCAB, MERGES)):
        sys.exit(f"needs {CORPUS}, {VOCAB} and {MERGES} (set MEGATRON_FLOW_SHARED to the shared folder)")
    os.environ.update(SINGLE_THREAD)

    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as workdir:
        whole, half = os.path.join(workdir, "whole.jsonl"), os.path.join(workdir, "half.jsonl")
        documents, text_bytes = extract(whole, args.mb)
        extract(half, args.mb / 2)
        print(
            f"input: {documents} GCIDE documents, {text_bytes / 2**20:.1f} MB of text; {args.workers} workers"
        )

        ours, bare = [], []  # (wall, CPU) seconds per repeat
        peaks = []
        for repeat in range(args.repeats):
            wall, cpu, peak, output = run_ours(whole, args.workers, workdir)
            ours.append((wall, cpu))
            peaks.append(peak)
            bare.append(run_bare(whole, args.workers))
            print(
                f"repeat {repeat}: ours {wall:.2f} s wall, {cpu:.2f} s CPU, peak {peak / 2**20:.0f} MiB; "
                f"bare {bare[-1][0]:.2f} s wall, {bare[-1][1]:.2f} s CPU"
            )
        _, _, half_peak, _ = run_ours(half, args.workers, workdir)
        reference = os.path.join(workdir, "bare_text_document")
        bare_files(whole, reference)
        identical = all(same_bytes(output + ext, reference + ext) for ext in (".bin", ".idx"))

    mb = text_bytes / 2**20
    ours_s, bare_s = (statistics.median(wall for wall, _ in runs) for runs in (ours, bare))
    for name, seconds in (("stages.tokenize  ", ours_s), ("bare encode_batch", bare_s)):
        print(f"{name}: {mb / seconds:7.2f} MB/s {documents / seconds:9.0f} docs/s (median {seconds:.2f} s)")
    print(f"peak RSS of our process tree: {max(peaks) / 2**20:.0f} MiB on the whole input, ", end="")
    print(f"{half_peak / 2**20:.0f} MiB on half of it")
    paired = sorted(b[0] / o[0] for b, o in zip(bare, ours, strict=True))
    print(
        f"per-repeat wall ratios (same moment, ours/bare throughput): {', '.join(f'{r:.3f}' for r in paired)}"
    )
    cpu_ratio = statistics.median(cpu for _, cpu in bare) / statistics.median(cpu for _, cpu in ours)
    print(
        f"CPU ratio (bare encode_batch CPU / CPU of our whole run, less sensitive to load): {cpu_ratio:.3f}"
    )
    print(f"files byte-identical to the bare encode_batch ids: {'yes' if identical else 'NO'}")
    print(f"ratio: {bare_s / ours_s:.3f}")
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
