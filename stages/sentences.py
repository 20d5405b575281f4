"""Rule-based sentence splitting for the tokenize stage (`--split-sentences`); downloads nothing.

Megatron uses NLTK punkt; these rules need no model:
- a sentence ends after `.`, `!`, `?` or `…` (a run of them, then any closing quotes or brackets) that is
  followed by whitespace and then an upper-case letter, a digit, an opening quote or bracket, or the end;
- except after a known abbreviation (Mr., Dr., Prof., St., vs., e.g., i.e., Fig., No., ...), a single-letter
  initial ("J. Smith") or a word with an inner period ("U.S.", "a.m."); decimals such as 3.14 never split
  because no whitespace follows the period;
- a blank line (paragraph break) always ends a sentence;
- without `--keep-newlines` each sentence is stripped of surrounding whitespace; with it, the whitespace
  and newlines after a sentence stay at its end, so the sentences concatenate back to the exact text.
"""

from __future__ import annotations

import re

# Words whose period does not end a sentence; not "etc.", which often does.
# fmt: off
ABBREVIATIONS = frozenset([
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "ft", "vs", "cf", "al", "fig", "figs",
    "no", "nos", "vol", "vols", "ch", "sec", "pp", "gen", "col", "lt", "sgt", "capt", "cmdr", "adm",
    "gov", "sen", "rep", "rev", "hon", "messrs", "mme", "mlle", "jan", "feb", "mar", "apr", "jun",
    "jul", "aug", "sep", "sept", "oct", "nov", "dec", "approx", "dept", "est", "inc", "ltd", "co",
    "corp", "univ",
])
# fmt: on
_CLOSERS = "\"'\u201d\u2019)]"
_SENTENCE_OPENERS = "\"'\u201c\u2018([{"
_SENTENCE_END = re.compile(r"[.!?\u2026]+[\"'\u201d\u2019)\]]*\s+|\n[ \t]*\n\s*")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def _is_sentence_end(text: str, match: re.Match) -> bool:
    """Whether a run of sentence-final punctuation and whitespace really ends a sentence."""
    if _BLANK_LINE.search(match.group()):
        return True
    following = text[match.end() : match.end() + 1]
    if not (following.isupper() or following.isdigit() or following in _SENTENCE_OPENERS):
        return False
    if match.group().rstrip().rstrip(_CLOSERS) != ".":  # '!', '?', '...': no abbreviation to rule out
        return True
    words = text[max(0, match.start() - 40) : match.start()].split()
    word = words[-1].lstrip(_SENTENCE_OPENERS) if words and not text[match.start() - 1].isspace() else ""
    is_initial = len(word) == 1 and word.isalpha()
    return not (is_initial or "." in word or word.lower() in ABBREVIATIONS)


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """The sentences of `text` by the rules in the module docstring."""
    sentences = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        if match.end() < len(text) and text[start : match.end()].strip() and _is_sentence_end(text, match):
            sentences.append(text[start : match.end()])
            start = match.end()
    sentences.append(text[start:])
    if keep_newlines:
        return [s for s in sentences if s]
    return [s.strip() for s in sentences if s.strip()]
