"""The shipped Retro corpus is the one `stages/corpora/make_stdlib_corpus.py` pins: its documents, ids and the
SHA-256 the script checks a rebuild against (a rebuild itself compresses 9 MB at xz's preset 9: a minute on the
shared cores, so it is not a test)."""

from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path

from stages.corpora import make_stdlib_corpus as corpus

CORPORA = Path(corpus.__file__).parent
SHIPPED = CORPORA / "stdlib.jsonl.xz"


def test_the_shipped_corpus_is_the_pinned_one():
    with lzma.open(SHIPPED, "rt", encoding="utf-8") as f:
        text = f.read()
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == corpus.CORPUS_SHA256
    ids = [json.loads(line)["id"] for line in text.splitlines()]
    releases = {doc_id.split("/", 1)[0] for doc_id in ids}
    modules = {doc_id.split("/", 1)[1] for doc_id in ids}
    assert (len(ids), releases, len(modules)) == (6 * 120, set(corpus.VERSIONS), corpus.MODULE_COUNT)
    # module by module, oldest release first: the validation split (the tail) is whole modules
    versions = len(corpus.VERSIONS)
    for start in range(0, len(ids), versions):
        module = ids[start].split("/", 1)[1]
        assert ids[start : start + versions] == [f"{version}/{module}" for version in corpus.VERSIONS]
    assert (CORPORA / "stdlib.LICENSE").read_text().startswith("A. HISTORY OF THE SOFTWARE")
