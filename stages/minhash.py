"""MinHash signatures, LSH banding and union-find: the pure, vectorised core of near-duplicate detection.

A batch of documents is turned into arrays without a Python loop per word or shingle:

1. normalize: lower-case, punctuation to spaces (`normalize_for_dedup`), UTF-8 bytes.
2. word hashes: a polynomial hash of each word's bytes, computed for all words at once from prefix sums
   modulo 2**64 (the multiplier is odd, hence invertible), then mixed with splitmix64.
3. shingle hashes: word n-grams hashed from their word hashes (an n-gram never crosses a document); a
   document shorter than n words is one shingle of all its words.
4. signatures: for each permutation i, min over the document's shingles x of (a_i * x + b_i) mod 2**32,
   with x the top 32 bits of the shingle's splitmix64 hash, a_i odd (so each map is a bijection of the 32-bit
   values) and b_i random: the multiply-add family in native uint32 arithmetic, about 20x faster than a
   universal hash modulo a Mersenne prime in uint64. This family is not min-wise independent for adversarial
   inputs, but its inputs are splitmix64 outputs: on them the Jaccard estimate has the binomial spread of
   truly random permutations (tests/test_dedup.py measures bias and spread).
5. LSH: each band of `rows` signature values becomes one 64-bit bucket key; documents sharing a bucket in any
   band are candidates, optionally verified by their estimated Jaccard similarity, and merged by union-find.
"""

from __future__ import annotations

import string

import numpy as np

EMPTY_SIGNATURE_VALUE = np.iinfo(np.uint32).max
_WORD_BASE = np.uint64(0x100000001B3)  # FNV-64 prime: odd, so invertible modulo 2**64
_SHINGLE_BASE = np.uint64(0x9E3779B97F4A7C15)
_UNICODE_PUNCTUATION = "".join(map(chr, range(0x2010, 0x2028))) + "\u00ab\u00bb\u00bf\u00a1"
_PUNCTUATION_TO_SPACE = str.maketrans(dict.fromkeys(string.punctuation + _UNICODE_PUNCTUATION, " "))
# Shingles hashed at once: keeps the (num_perm x shingles) uint32 temporary small (1.6 MB at 100 permutations),
# in cache and on reused pages; 64K shingles per chunk run about 5x slower.
SHINGLES_PER_CHUNK = 1 << 12
# Bytes of text per shingle_hashes call whose powers of the word-hash base are cached (4 MB per base): more
# than the dedup stage's batches (stages/dedup.py BATCH_TEXT_BYTES).
POWERS_CACHED = 1 << 19
_POWER_TABLES: dict[int, np.ndarray] = {}


def normalize_for_dedup(text: str) -> str:
    """Lower-case, punctuation (ASCII and common Unicode) to spaces, whitespace collapsed, stripped."""
    return " ".join(text.lower().translate(_PUNCTUATION_TO_SPACE).split())


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (Steele et al.'s SplitMix64 finalizer), elementwise, wrapping."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _power_table(base: np.uint64, n: int) -> np.ndarray:
    """base**0 .. base**(n-1) modulo 2**64."""
    powers = np.full(n, base, dtype=np.uint64)
    powers[0] = 1
    return np.cumprod(powers, dtype=np.uint64)


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """base**0 .. base**(n-1) modulo 2**64, read-only; up to POWERS_CACHED entries come from a table computed
    once per process (recomputing it per batch cost about 9% of the signature step)."""
    if n > POWERS_CACHED:
        return _power_table(base, n)
    if int(base) not in _POWER_TABLES:
        _POWER_TABLES[int(base)] = _power_table(base, POWERS_CACHED)
        _POWER_TABLES[int(base)].setflags(write=False)
    return _POWER_TABLES[int(base)][:n]


def shingle_hashes(normalized: list[str], shingle_size: int) -> tuple[np.ndarray, np.ndarray]:
    """32-bit hashes (uint32) of every document's word n-grams, back to back, and each document's
    count of them.

    `normalized` texts come from `normalize_for_dedup` (words separated by single spaces).
    """
    data = np.frombuffer(" ".join(normalized).encode() + b" ", dtype=np.uint8)
    doc_bytes = np.fromiter((len(t.encode()) + 1 for t in normalized), dtype=np.int64, count=len(normalized))
    is_space = data == ord(" ")
    # Word boundaries: a word starts after a space (or at 0) and ends at a space.
    starts = np.flatnonzero(~is_space & np.concatenate(([True], is_space[:-1])))
    ends = np.flatnonzero(is_space & np.concatenate(([False], ~is_space[:-1])))
    word_doc = np.searchsorted(np.cumsum(doc_bytes), starts, side="right")

    # Polynomial word hash sum_j c_j * B**(j - start) from prefix sums of c_j * B**-j (mod 2**64).
    inverse_base = np.uint64(pow(int(_WORD_BASE), -1, 1 << 64))
    prefix = np.zeros(len(data) + 1, dtype=np.uint64)
    np.cumsum(data.astype(np.uint64) * _powers(inverse_base, len(data)), out=prefix[1:])
    word_hash = splitmix64((prefix[ends] - prefix[starts]) * _powers(_WORD_BASE, len(data))[starts])

    n_words = len(word_hash)
    words_per_doc = np.bincount(word_doc, minlength=len(normalized))
    doc_end = np.cumsum(words_per_doc)[word_doc]  # index one past each word's document's last word
    shingle = np.zeros(n_words, dtype=np.uint64)
    for j in range(shingle_size):
        inside = np.arange(n_words) + j < doc_end
        shifted = np.zeros(n_words, dtype=np.uint64)
        shifted[: max(n_words - j, 0)] = word_hash[j:]
        shingle = np.where(inside, shingle * _SHINGLE_BASE + shifted, shingle)
    # Keep full n-grams, plus the one shingle of a document shorter than n words (its first word).
    doc_start = doc_end - words_per_doc[word_doc]
    position = np.arange(n_words)
    keep = (position + shingle_size <= doc_end) | (
        (position == doc_start) & (words_per_doc[word_doc] < shingle_size)
    )
    counts = np.bincount(word_doc[keep], minlength=len(normalized))
    return (splitmix64(shingle[keep]) >> np.uint64(32)).astype(np.uint32), counts


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The multiply-add hash functions' (a, b) coefficients, uint32: a odd, b any."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 1 << 32, size=num_perm, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
    b = rng.integers(0, 1 << 32, size=num_perm, dtype=np.uint64).astype(np.uint32)
    return a, b


def signatures(hashes: np.ndarray, counts: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """MinHash signatures (documents x num_perm, uint32) from uint32 shingle `hashes` and coefficients; a
    document without shingles gets the EMPTY_SIGNATURE_VALUE signature, shared by all empty documents (another
    document gets it only if all num_perm functions map all its shingles to 2**32 - 1)."""
    if not hashes.dtype == a.dtype == b.dtype == np.uint32:
        raise TypeError(
            f"hashes, a and b must be uint32 (arithmetic wraps modulo 2**32), got {hashes.dtype}, "
            f"{a.dtype}, {b.dtype}: use shingle_hashes() and permutations()"
        )
    n_docs, num_perm = len(counts), len(a)
    out = np.full((n_docs, num_perm), EMPTY_SIGNATURE_VALUE, dtype=np.uint32)
    docs = np.flatnonzero(counts)
    offsets = np.concatenate(([0], np.cumsum(counts)))
    chunk_start = 0
    while chunk_start < len(docs):
        # Whole documents, up to SHINGLES_PER_CHUNK shingles (at least one document).
        first = offsets[docs[chunk_start]]
        limit = np.searchsorted(offsets[docs + 1], first + SHINGLES_PER_CHUNK, side="right")
        chunk_end = max(limit, chunk_start + 1)
        chunk_docs = docs[chunk_start:chunk_end]
        x = hashes[first : offsets[chunk_docs[-1] + 1]]
        values = a[:, None] * x[None, :]  # uint32: wraps modulo 2**32
        values += b[:, None]
        out[chunk_docs] = np.minimum.reduceat(values, offsets[chunk_docs] - first, axis=1).T
        chunk_start = chunk_end
    return out


def band_keys(signature: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One 64-bit bucket key per (document, band) from that band's `rows` signature values."""
    if bands * rows > signature.shape[1]:
        raise ValueError(f"bands x rows = {bands * rows} exceeds the signature length {signature.shape[1]}")
    keys = np.zeros((signature.shape[0], bands), dtype=np.uint64)
    for r in range(rows):
        keys = splitmix64(keys ^ signature[:, r : bands * rows : rows].astype(np.uint64))
    return keys


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
    """The LSH S-curve: probability that two documents at this Jaccard similarity share a bucket."""
    return 1.0 - (1.0 - similarity**rows) ** bands


def bucket_pairs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, other) index pairs of rows sharing a key, one column (band) at a time; `first` is the
    smallest index in its bucket, so a pair never repeats within a band. Unique pairs across bands."""
    firsts, others = [], []
    for band in range(keys.shape[1]):
        order = np.argsort(keys[:, band], kind="stable")
        sorted_keys = keys[order, band]
        run_start = np.ones(len(order), dtype=bool)
        run_start[1:] = sorted_keys[1:] != sorted_keys[:-1]
        run_first = order[np.maximum.accumulate(np.where(run_start, np.arange(len(order)), 0))]
        firsts.append(run_first[~run_start])
        others.append(order[~run_start])
    if not firsts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    pairs = np.unique(np.stack([np.concatenate(firsts), np.concatenate(others)], axis=1), axis=0)
    return pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)


def estimated_jaccard(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Fraction of equal signature values, row by row: an unbiased estimate of Jaccard similarity."""
    return (left == right).mean(axis=1)


class UnionFind:
    """Disjoint sets over 0..n-1 whose root is always the smallest member: the document kept."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, x: int, y: int) -> None:
        rx, ry = self.find(x), self.find(y)
        if rx != ry:
            self.parent[max(rx, ry)] = min(rx, ry)

    def union_pairs(self, first: np.ndarray, other: np.ndarray) -> None:
        for x, y in zip(first.tolist(), other.tolist(), strict=True):
            self.union(x, y)

    def roots(self) -> np.ndarray:
        """Every element's root, by pointer jumping over the whole parent array at once."""
        parent = np.array(self.parent, dtype=np.int64)
        while not np.array_equal(grandparent := parent[parent], parent):
            parent = grandparent
        return parent


def near_duplicate_groups(
    texts: list[str],
    threshold: float,
    num_perm: int = 256,
    bands: int = 64,
    shingle_size: int = 5,
    seed: int = 0,
) -> np.ndarray:
    """int64 [len(texts)]: each text's group, the smallest index of the texts joined to it by pairs of estimated
    Jaccard similarity >= `threshold` (LSH candidates of `bands` bands, verified, merged by union-find). In
    memory: for the document counts of a Retro database, not a web crawl (the dedup stage shards that)."""
    hashes, counts = shingle_hashes([normalize_for_dedup(text) for text in texts], shingle_size)
    signature = signatures(hashes, counts, *permutations(num_perm, seed))
    first, other = bucket_pairs(band_keys(signature, bands, num_perm // bands))
    similar = estimated_jaccard(signature[first], signature[other]) >= threshold
    groups = UnionFind(len(texts))
    groups.union_pairs(first[similar], other[similar])
    return groups.roots()
