"""Build `stdlib.jsonl.xz`, the Retro flow's default corpus: the same standard-library modules in six CPython
versions, one document per (version, module).

    python stages/corpora/make_stdlib_corpus.py stages/corpora/stdlib.jsonl.xz \\
        /root/.pyenv/versions/{3.8.18,3.9.18,3.10.13,3.11.7,3.12.1,3.13.0}/lib/python3.*

The Lib folders are given in the order of `VERSIONS` (any copy of those releases' `Lib`: a pyenv install's
`lib/python3.X`, or the source tree's `Lib`). The modules are `MODULE_COUNT` of the listed modules found in every
version (at most 40 kB in each), drawn with seed 0 from their sorted paths. Each module's source in each version
is read through the download stage's reader of one-file-one-document text files (`storage.documents.iter_records`)
and written as one JSON Lines record, `{"id": "<version>/<path in Lib>", "text": <source>}`, module by module
(in the drawn order), each module's versions oldest first, compressed with xz. Megatron's `--split` cuts the
validation documents from the end, so they are whole modules (all their releases, bar the module the cut falls
in): before the Retro flow's database update no release of them is in the database, after it their own text is. The script checks the JSON Lines' SHA-256 against `CORPUS_SHA256`, so a Lib folder of another release
is an error, not another corpus. The file is shipped, so every machine builds the same corpus whatever Python it
runs; the sources are under the PSF licence (`stdlib.LICENSE`, CPython 3.12.1's LICENSE file).

Why six versions: Retro reads what other documents hold, and a module's other releases hold its continuation
with small changes (near-copies); a module unchanged between releases is an exact copy, which the flow's exact
deduplication keeps once (the first in this order).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import lzma
import os
import random
import sys

from storage.documents import iter_records

VERSIONS = ("3.8.18", "3.9.18", "3.10.13", "3.11.7", "3.12.1", "3.13.0")
# Lib-relative glob patterns of the modules, and what is left out of them: tests (they quote each other's
# fixtures at length) and generated data files (pydoc's topics, a 700 kB string).
MODULES = (
    "*.py",
    "asyncio/*.py",
    "collections/*.py",
    "concurrent/futures/*.py",
    "email/*.py",
    "encodings/*.py",
    "http/*.py",
    "json/*.py",
    "logging/*.py",
    "multiprocessing/*.py",
    "urllib/*.py",
    "xml/*/*.py",
)
EXCLUDED = ("test*", "*/test*", "__phello__*", "_sysconfigdata*", "pydoc_data/*")
# Modules of at most 40 kB: the giants (_pydecimal, turtle, inspect, typing, ...) would each fill much of the
# validation split and lengthen the time `make retro` spends embedding.
MAX_MODULE_BYTES = 40_000
# 120 of the 327 listed modules found in all six versions: 720 documents, 315 distinct texts of 4.5 MB (as much
# code as one version's 354 modules, the corpus before), so embedding and querying take the time they took.
MODULE_COUNT = 120
CORPUS_SHA256 = "6e481fad0aa80aaed855158be223e901d1eb96f7cdc5890a0907b26feb619dab"


def module_paths(lib: str) -> list[str]:
    """The Lib-relative paths of the listed modules under `lib` (at most MAX_MODULE_BYTES each), sorted."""
    found = set()
    for root, _, files in os.walk(lib):
        for name in files:
            path = os.path.relpath(os.path.join(root, name), lib)
            listed = any(
                fnmatch.fnmatch(path, pattern) and path.count("/") == pattern.count("/")
                for pattern in MODULES
            )
            excluded = any(fnmatch.fnmatch(path, pattern) for pattern in EXCLUDED)
            if listed and not excluded and os.path.getsize(os.path.join(root, name)) <= MAX_MODULE_BYTES:
                found.add(path)
    return sorted(found)


def corpus_documents(libs: list[str]) -> list[tuple[str, str]]:
    """(id, Lib file) of every document, in the corpus's order: module by module in their drawn order, each
    module's six versions oldest first."""
    common = sorted(set.intersection(*(set(module_paths(lib)) for lib in libs)))
    modules = random.Random(0).sample(common, MODULE_COUNT)
    return [
        (f"{version}/{path}", os.path.join(lib, path))
        for path in modules
        for version, lib in zip(VERSIONS, libs, strict=True)
    ]


def main(out: str, libs: list[str]) -> None:
    lines = []
    for doc_id, path in corpus_documents(libs):
        (record,) = iter_records(path)
        lines.append(json.dumps({"id": doc_id, "text": record.data["text"]}, ensure_ascii=False) + "\n")
    text = "".join(lines)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != CORPUS_SHA256:
        sys.exit(
            f"{out}: not written: its JSON Lines have SHA-256 {digest}, the pinned corpus {CORPUS_SHA256}; "
            f"give the Lib folders of CPython {', '.join(VERSIONS)} in that order"
        )
    with lzma.open(out, "wt", encoding="utf-8", preset=9) as f:
        f.write(text)
    print(f"{out}: {len(lines)} documents, {MODULE_COUNT} modules of CPython {', '.join(VERSIONS)}")


if __name__ == "__main__":
    usage = (
        f"usage: make_stdlib_corpus.py OUT.jsonl.xz LIB_DIR x{len(VERSIONS)} "
        f"(the Lib folders of CPython {', '.join(VERSIONS)}, in that order)"
    )
    if len(sys.argv) != 2 + len(VERSIONS):
        sys.exit(usage)
    not_lib = [lib for lib in sys.argv[2:] if not os.path.isfile(os.path.join(lib, "asyncio", "events.py"))]
    if not_lib:
        sys.exit(f"{not_lib[0]}: not a CPython Lib folder (no asyncio/events.py); {usage}")
    main(sys.argv[1], sys.argv[2:])
