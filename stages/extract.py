"""HTML main-text extraction of the clean stage: resiliparse (the default) or trafilatura, by `--clean.extractor`.

Both keep the page's main content and leave out navigation, headers, footers, comments, forms and scripts.
trafilatura runs as datatrove's `Trafilatura` block calls it (favour precision, no comments) except for its
cross-document deduplication: that cache depends on which pages a process saw before, so the same shard would
give other text on another worker; a page's text here depends on the page alone.
"""

from __future__ import annotations

EXTRACTORS = ("resiliparse", "trafilatura")


def extract_main_text(html: str, extractor: str) -> str:
    """The main text of one HTML page ('' when it has none)."""
    if extractor == "resiliparse":
        from resiliparse.extract.html2text import extract_plain_text

        return extract_plain_text(
            html,
            preserve_formatting=True,
            main_content=True,
            alt_texts=False,
            comments=False,
            form_fields=False,
            noscript=False,
            links=False,
        )
    if extractor == "trafilatura":
        import trafilatura

        return (
            trafilatura.extract(html, favor_precision=True, include_comments=False, deduplicate=False) or ""
        )
    raise ValueError(f"unknown extractor {extractor!r}; choose one of {', '.join(EXTRACTORS)}")
