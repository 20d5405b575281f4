"""Document quality filters in the style of Gopher (Rae et al. 2021, appendix A), C4 (Raffel et al. 2020),
FineWeb (Penedo et al. 2024; datatrove's `FineWebQualityFilter`) and Megatron-LM's openwebtext cleanup, and for
source code Codex's (Chen et al. 2021, section 3.1): pure functions of the text, each switchable. The FineWeb
rules are off unless `fineweb` is set.

`first_failing_rule(text, params)` checks the rules in `RULES` order and returns the name of the first one
that drops the document (or None), so a stage can count drops per rule. A rule whose parameter is None or
False is off.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import regex

# Gopher's stop words: a document must contain at least `min_stop_words` of them (as words).
GOPHER_STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
BULLETS = ("\u2022", "\u2023", "\u25cf", "\u25e6", "\u2043", "\u25aa", "-", "*", "+")
ELLIPSES = ("...", "\u2026")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_JAVASCRIPT = re.compile(r"\bjavascript\b", re.IGNORECASE)
_LETTER = re.compile(r"[^\W\d_]")
_NGRAM_BASE = np.uint64(0x100000001B3)
# Unicode's sentence terminals (., !, ?, 。, ।, ...): the characters datatrove's TERMINAL_PUNCTUATION lists.
_SENTENCE_END = regex.compile(r"\p{Sentence_Terminal}$")


@dataclass(frozen=True)
class QualityParams:
    """Thresholds; None (or False) switches a rule off.

    Defaults are Gopher's and C4's. They keep 1,076 of the embedded KJV's 1,189 chapters; the others are
    genealogies, inventories and refrains that Gopher's repetition rules call repetitive.
    """

    min_words: int | None = 50
    max_words: int | None = 100_000
    min_mean_word_length: float | None = 3.0
    max_mean_word_length: float | None = 10.0
    max_symbol_word_ratio: float | None = 0.1  # '#' and ellipses per word
    max_bullet_lines_fraction: float | None = 0.9
    max_ellipsis_lines_fraction: float | None = 0.3
    min_alpha_words_fraction: float | None = 0.8  # words with at least one letter
    min_stop_words: int | None = 2
    max_duplicate_lines_fraction: float | None = 0.3
    max_duplicate_paragraphs_fraction: float | None = 0.3
    max_duplicate_line_chars_fraction: float | None = 0.2
    max_duplicate_paragraph_chars_fraction: float | None = 0.2
    # (n, max fraction of characters in the most frequent word n-gram)
    max_top_ngram_chars_fraction: tuple[tuple[int, float], ...] | None = ((2, 0.20), (3, 0.18), (4, 0.16))
    # (n, max fraction of characters in word n-grams that occur more than once)
    max_duplicate_ngram_chars_fraction: tuple[tuple[int, float], ...] | None = (
        (5, 0.15),
        (6, 0.14),
        (7, 0.13),
        (8, 0.12),
        (9, 0.11),
        (10, 0.10),
    )
    c4_lorem_ipsum: bool = True  # drop pages containing "lorem ipsum"
    c4_curly_brace: bool = True  # drop pages containing "{" (code)
    c4_javascript: bool = True  # drop pages where a line mentions JavaScript ("please enable JavaScript")
    # FineWeb's rules (all off unless `fineweb`; None switches one off), on non-blank lines:
    fineweb: bool = False
    fineweb_min_line_punct_ratio: float | None = 0.12  # lines ending in a sentence terminal
    fineweb_max_short_line_ratio: float | None = 0.67  # lines of at most `fineweb_short_line_chars`
    fineweb_short_line_chars: int = 30
    fineweb_max_char_duplicates_ratio: float | None = 0.01  # characters in repeated lines / all (no newlines)
    fineweb_max_newline_ratio: float | None = 0.3  # newlines per word ("list-like" pages)
    # Codex's filters of source files (off by default; `code()` turns them on): data dumps and generated files
    max_line_length: int | None = None
    max_mean_line_length: float | None = None
    min_alphanumeric_fraction: float | None = None

    @classmethod
    def code(cls, **overrides) -> QualityParams:
        """The profile for source code: the prose rules off (C4's curly-brace rule, stop words, word lengths,
        symbols and Gopher's repetition rules would drop most code, whose lines and n-grams repeat by design);
        Codex's rules on (a line over 1000 characters, lines of 100 on average, or under a quarter of the
        characters alphanumeric mark generated or data files); at least 20 words (an `__init__.py` with an
        import or two says nothing)."""
        prose_off = {
            name: None
            for name in (
                "min_mean_word_length", "max_mean_word_length", "max_symbol_word_ratio", "max_bullet_lines_fraction",
                "max_ellipsis_lines_fraction", "min_alpha_words_fraction", "min_stop_words",
                "max_duplicate_lines_fraction", "max_duplicate_paragraphs_fraction",
                "max_duplicate_line_chars_fraction", "max_duplicate_paragraph_chars_fraction",
                "max_top_ngram_chars_fraction", "max_duplicate_ngram_chars_fraction",
            )
        }  # fmt: skip
        return cls(**{
            **prose_off, "min_words": 20, "c4_lorem_ipsum": False, "c4_curly_brace": False, "c4_javascript": False,
            "max_line_length": 1000, "max_mean_line_length": 100.0, "min_alphanumeric_fraction": 0.25, **overrides,
        })  # fmt: skip


class TextStats:
    """Features of one document, each computed once, on first use."""

    def __init__(self, text: str):
        self.text = text

    @cached_property
    def words(self) -> list[str]:
        return self.text.split()

    @cached_property
    def lines(self) -> list[str]:
        return [line for line in (raw.strip() for raw in self.text.split("\n")) if line]

    @cached_property
    def nonblank_lines(self) -> list[str]:
        """Lines as FineWeb counts them: not stripped, blank ones left out."""
        return [line for line in self.text.split("\n") if line.strip()]

    @cached_property
    def paragraphs(self) -> list[str]:
        return [p for p in (raw.strip() for raw in _PARAGRAPH_BREAK.split(self.text)) if p]

    @cached_property
    def bare_words(self) -> list[str]:
        """Lower-cased words without surrounding punctuation (empty ones removed), for n-gram rules."""
        return [w for w in (w.strip(string.punctuation).lower() for w in self.words) if w]

    @cached_property
    def bare_word_ids(self) -> np.ndarray:
        """bare_words as integers (equal words, equal ids), so n-grams are hashed with numpy."""
        vocabulary: dict[str, int] = {}
        return np.array([vocabulary.setdefault(w, len(vocabulary)) for w in self.bare_words], dtype=np.uint64)

    @cached_property
    def bare_word_lengths(self) -> np.ndarray:
        return np.array([len(w) for w in self.bare_words], dtype=np.int64)


def _duplicate_fractions(items: list[str]) -> tuple[float, float]:
    """(fraction of items that repeat an earlier one, fraction of characters in those repeats)."""
    seen: set[str] = set()
    repeated = repeated_chars = 0
    for item in items:
        if item in seen:
            repeated += 1
            repeated_chars += len(item)
        seen.add(item)
    total_chars = sum(len(item) for item in items)
    return repeated / max(len(items), 1), repeated_chars / max(total_chars, 1)


def ngram_keys(word_ids: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit key per word n-gram (position i: words i .. i+n-1); equal n-grams get equal keys."""
    keys = np.zeros(len(word_ids) - n + 1, dtype=np.uint64)
    for j in range(n):
        keys = keys * _NGRAM_BASE + word_ids[j : len(word_ids) - n + 1 + j]
    return keys


def top_ngram_chars_fraction(word_ids: np.ndarray, word_lengths: np.ndarray, n: int) -> float:
    """Characters in all occurrences of the most frequent word n-gram (the earliest among equals) over all
    word characters (Gopher)."""
    if len(word_ids) < n:
        return 0.0
    _, first, counts = np.unique(ngram_keys(word_ids, n), return_index=True, return_counts=True)
    top = counts.max()
    if top < 2:
        return 0.0
    start = first[counts == top].min()
    return float(word_lengths[start : start + n].sum() * top / max(word_lengths.sum(), 1))


def duplicate_ngram_chars_fraction(word_ids: np.ndarray, word_lengths: np.ndarray, n: int) -> float:
    """Characters of words covered by a repeat of an earlier word n-gram over all word characters (Gopher;
    a word counts once however many repeats cover it; first occurrences do not count)."""
    if len(word_ids) < n:
        return 0.0
    _, first = np.unique(ngram_keys(word_ids, n), return_index=True)
    repeat = np.ones(len(word_ids) - n + 1, dtype=bool)
    repeat[first] = False
    # Words covered by some repeated n-gram: +1 where a repeat starts, -1 n words later, running sum > 0.
    starts = np.flatnonzero(repeat)
    depth = np.zeros(len(word_ids) + 1, dtype=np.int64)
    np.add.at(depth, starts, 1)
    np.add.at(depth, starts + n, -1)
    covered = np.cumsum(depth[:-1]) > 0
    return float(word_lengths[covered].sum() / max(word_lengths.sum(), 1))


def too_few_words(s: TextStats, p: QualityParams) -> bool:
    return p.min_words is not None and len(s.words) < p.min_words


def too_many_words(s: TextStats, p: QualityParams) -> bool:
    return p.max_words is not None and len(s.words) > p.max_words


def mean_word_length_out_of_range(s: TextStats, p: QualityParams) -> bool:
    mean = sum(len(w) for w in s.words) / max(len(s.words), 1)
    too_short = p.min_mean_word_length is not None and mean < p.min_mean_word_length
    return too_short or (p.max_mean_word_length is not None and mean > p.max_mean_word_length)


def too_many_symbols(s: TextStats, p: QualityParams) -> bool:
    if p.max_symbol_word_ratio is None:
        return False
    symbols = s.text.count("#") + sum(s.text.count(e) for e in ELLIPSES)
    return symbols / max(len(s.words), 1) > p.max_symbol_word_ratio


def too_many_bullet_lines(s: TextStats, p: QualityParams) -> bool:
    if p.max_bullet_lines_fraction is None or not s.lines:
        return False
    bullets = sum(line.startswith(BULLETS) for line in s.lines)
    return bullets / len(s.lines) > p.max_bullet_lines_fraction


def too_many_ellipsis_lines(s: TextStats, p: QualityParams) -> bool:
    if p.max_ellipsis_lines_fraction is None or not s.lines:
        return False
    ellipses = sum(line.endswith(ELLIPSES) for line in s.lines)
    return ellipses / len(s.lines) > p.max_ellipsis_lines_fraction


def too_few_alpha_words(s: TextStats, p: QualityParams) -> bool:
    if p.min_alpha_words_fraction is None or not s.words:
        return False
    alpha = sum(_LETTER.search(w) is not None for w in s.words)
    return alpha / len(s.words) < p.min_alpha_words_fraction


def too_few_stop_words(s: TextStats, p: QualityParams) -> bool:
    if p.min_stop_words is None:
        return False
    return sum(w in GOPHER_STOP_WORDS for w in s.bare_words) < p.min_stop_words


def duplicate_lines(s: TextStats, p: QualityParams) -> bool:
    fraction, chars = _duplicate_fractions(s.lines)
    too_many = p.max_duplicate_lines_fraction is not None and fraction > p.max_duplicate_lines_fraction
    return too_many or (
        p.max_duplicate_line_chars_fraction is not None and chars > p.max_duplicate_line_chars_fraction
    )


def duplicate_paragraphs(s: TextStats, p: QualityParams) -> bool:
    fraction, chars = _duplicate_fractions(s.paragraphs)
    too_many = (
        p.max_duplicate_paragraphs_fraction is not None and fraction > p.max_duplicate_paragraphs_fraction
    )
    limit = p.max_duplicate_paragraph_chars_fraction
    return too_many or (limit is not None and chars > limit)


def top_ngram_repetition(s: TextStats, p: QualityParams) -> bool:
    limits = p.max_top_ngram_chars_fraction or ()
    return any(
        top_ngram_chars_fraction(s.bare_word_ids, s.bare_word_lengths, n) > limit for n, limit in limits
    )


def duplicate_ngram_repetition(s: TextStats, p: QualityParams) -> bool:
    limits = p.max_duplicate_ngram_chars_fraction or ()
    return any(
        duplicate_ngram_chars_fraction(s.bare_word_ids, s.bare_word_lengths, n) > limit for n, limit in limits
    )


def c4_lorem_ipsum(s: TextStats, p: QualityParams) -> bool:
    return p.c4_lorem_ipsum and "lorem ipsum" in s.text.lower()


def c4_curly_brace(s: TextStats, p: QualityParams) -> bool:
    return p.c4_curly_brace and "{" in s.text


def c4_javascript(s: TextStats, p: QualityParams) -> bool:
    return p.c4_javascript and _JAVASCRIPT.search(s.text) is not None


def fineweb_line_punct(s: TextStats, p: QualityParams) -> bool:
    limit = p.fineweb_min_line_punct_ratio
    if not p.fineweb or limit is None or not s.nonblank_lines:
        return False
    ended = sum(_SENTENCE_END.search(line) is not None for line in s.nonblank_lines)
    return ended / len(s.nonblank_lines) < limit


def fineweb_short_lines(s: TextStats, p: QualityParams) -> bool:
    limit = p.fineweb_max_short_line_ratio
    if not p.fineweb or limit is None or not s.nonblank_lines:
        return False
    short = sum(len(line) <= p.fineweb_short_line_chars for line in s.nonblank_lines)
    return short / len(s.nonblank_lines) > limit


def fineweb_char_duplicates(s: TextStats, p: QualityParams) -> bool:
    limit = p.fineweb_max_char_duplicates_ratio
    if not p.fineweb or limit is None:
        return False
    _, repeated_chars = _duplicate_fractions(s.nonblank_lines)
    line_chars = sum(len(line) for line in s.nonblank_lines)
    return repeated_chars * line_chars / max(len(s.text.replace("\n", "")), 1) > limit


def fineweb_newlines(s: TextStats, p: QualityParams) -> bool:
    limit = p.fineweb_max_newline_ratio
    return p.fineweb and limit is not None and s.text.count("\n") / max(len(s.words), 1) > limit


def line_too_long(s: TextStats, p: QualityParams) -> bool:
    return p.max_line_length is not None and max(map(len, s.text.split("\n"))) > p.max_line_length


def mean_line_too_long(s: TextStats, p: QualityParams) -> bool:
    if p.max_mean_line_length is None:
        return False
    raw_lines = s.text.split("\n")
    return sum(map(len, raw_lines)) / len(raw_lines) > p.max_mean_line_length


def too_few_alphanumerics(s: TextStats, p: QualityParams) -> bool:
    if p.min_alphanumeric_fraction is None or not s.text:
        return False
    return sum(ch.isalnum() for ch in s.text) / len(s.text) < p.min_alphanumeric_fraction


# Cheap rules first: the first failing rule is the one counted.
RULES: dict[str, Callable[[TextStats, QualityParams], bool]] = {
    "too_few_words": too_few_words,
    "too_many_words": too_many_words,
    "mean_word_length": mean_word_length_out_of_range,
    "symbol_word_ratio": too_many_symbols,
    "bullet_lines": too_many_bullet_lines,
    "ellipsis_lines": too_many_ellipsis_lines,
    "alpha_words": too_few_alpha_words,
    "stop_words": too_few_stop_words,
    "c4_lorem_ipsum": c4_lorem_ipsum,
    "c4_curly_brace": c4_curly_brace,
    "c4_javascript": c4_javascript,
    "line_length": line_too_long,
    "mean_line_length": mean_line_too_long,
    "alphanumeric_fraction": too_few_alphanumerics,
    "duplicate_lines": duplicate_lines,
    "duplicate_paragraphs": duplicate_paragraphs,
    "top_ngram_repetition": top_ngram_repetition,
    "duplicate_ngram_repetition": duplicate_ngram_repetition,
    "fineweb_line_punct": fineweb_line_punct,
    "fineweb_short_lines": fineweb_short_lines,
    "fineweb_char_duplicates": fineweb_char_duplicates,
    "fineweb_newlines": fineweb_newlines,
}
FINEWEB_RULES = ("fineweb_line_punct", "fineweb_short_lines", "fineweb_char_duplicates", "fineweb_newlines")


def rule_names(params: QualityParams) -> list[str]:
    """The rules a stage reports counts for: all but the FineWeb ones, which only when `fineweb` is on."""
    return [name for name in RULES if params.fineweb or name not in FINEWEB_RULES]


def first_failing_rule(text: str, params: QualityParams) -> str | None:
    """The name of the first rule in `RULES` that drops `text`, or None when it passes them all."""
    stats = TextStats(text)
    for name, rule in RULES.items():
        if rule(stats, params):
            return name
    return None
