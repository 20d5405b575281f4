"""Build `stdlib.jsonl.xz`, the Retro flow's default corpus: a fixed list of CPython standard-library modules.

    python stages/corpora/make_stdlib_corpus.py /path/to/cpython-3.12.1/Lib stages/corpora/stdlib.jsonl.xz

Reads each listed module's source through the download stage's reader of one-file-one-document text files
(`storage.documents.iter_records`) and writes one JSON Lines record per module, `{"id": "<path in Lib>",
"text": <source>}`, in a fixed random order (seed 0: the validation split, the last documents, is then a random
sample of modules, not the alphabetically last), compressed with xz. The result is shipped, so every machine
builds the same corpus whatever Python it runs; the module sources are under the PSF licence
(`stdlib.LICENSE`, CPython's LICENSE file). Source code repeats itself across files (the charmap codecs of
`encodings/`, the event loops of `asyncio`, the pure-Python twins of C modules), which is what Retro feeds on.
"""

from __future__ import annotations

import fnmatch
import json
import lzma
import os
import random
import sys

from storage.documents import iter_records

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
# Modules of at most 40 kB (354 of 3.12's 405 listed, 4.3 of 8.1 MB): the giants (_pydecimal, turtle, inspect,
# typing, ...) would each fill much of the validation split and double the time `make retro` spends embedding.
MAX_MODULE_BYTES = 40_000


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


def main(lib: str, out: str) -> None:
    paths = module_paths(lib)
    random.Random(0).shuffle(paths)
    with lzma.open(out, "wt", encoding="utf-8", preset=9) as f:
        for path in paths:
            (record,) = iter_records(os.path.join(lib, path))
            f.write(json.dumps({"id": path, "text": record.data["text"]}, ensure_ascii=False) + "\n")
    print(f"{out}: {len(paths)} modules of {lib}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or not os.path.isfile(os.path.join(sys.argv[1], "asyncio", "events.py")):
        sys.exit(
            "usage: make_stdlib_corpus.py CPYTHON_LIB_DIR OUT.jsonl.xz (the Lib folder of CPython 3.12.1)"
        )
    main(*sys.argv[1:])
