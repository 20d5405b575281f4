"""Web pages and WARC files that tests and benchmarks/curation.py write themselves.

A page is a real-looking HTML document: a site's navigation, cookie banner, sidebar and footer (boilerplate an
extractor must leave out), scripts and styles, around an article of paragraphs. English articles are King James
Bible verses from the embedded corpus; German, French and Spanish ones are sentences drawn from small
hand-written vocabularies (fastText's lid.176 tells them apart with high confidence).
"""

from __future__ import annotations

import html
import io
import json
import lzma
import random
from collections.abc import Iterable
from dataclasses import dataclass

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

from stages.download import EMBEDDED_CORPUS

WARC_DATE = "2024-05-01T12:00:00Z"

_FOREIGN_WORDS = {
    "de": (
        "der die das und ist nicht ein eine mit auf für von dem den zu im sich auch es sie wir haben wird "
        "wurde werden nach bei aus über unter zwischen heute morgen immer wieder schon noch sehr viele alle "
        "Stadt Land Haus Schule Arbeit Familie Kinder Zeit Jahr Woche Geschichte Regierung Menschen Wasser "
        "schnell langsam groß klein neue alte wichtige schöne deutsche gemeinsam gestern besonders"
    ),
    "fr": (
        "le la les et est pas un une avec sur pour de du des dans qui que nous vous ils elles ont sont "
        "était sera très aussi encore toujours déjà beaucoup tous toutes ville pays maison école travail "
        "famille enfants temps année semaine histoire gouvernement gens eau rapide lent grand petit "
        "nouvelle ancienne importante belle française ensemble hier surtout aujourd'hui"
    ),
    "es": (
        "el la los las y es no un una con sobre para de del en que nosotros ellos ellas han son era será "
        "muy también todavía siempre ya mucho todos todas ciudad país casa escuela trabajo familia niños "
        "tiempo año semana historia gobierno gente agua rápido lento grande pequeño nueva antigua "
        "importante hermosa española juntos ayer especialmente hoy"
    ),
}


@dataclass(frozen=True)
class Page:
    """One WARC record: a response (with its HTTP Content-Type) or another record type."""

    url: str
    body: bytes
    content_type: str = "text/html; charset=utf-8"
    record_type: str = "response"


def kjv_chapters() -> list[str]:
    """The embedded corpus's chapters, verses one a line."""
    with lzma.open(EMBEDDED_CORPUS, "rt") as f:
        return [json.loads(line)["text"] for line in f]


def foreign_paragraphs(language: str, rng: random.Random, count: int) -> list[str]:
    """Paragraphs of 4 to 6 sentences of 8 to 15 words of `language` (de, fr or es)."""
    words = _FOREIGN_WORDS[language].split()
    paragraphs = []
    for _ in range(count):
        sentences = []
        for _ in range(rng.randint(4, 6)):
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(8, 15)))
            sentences.append(sentence[0].upper() + sentence[1:] + ".")
        paragraphs.append(" ".join(sentences))
    return paragraphs


def html_page(title: str, paragraphs: Iterable[str], site: str, language: str = "en", links: int = 12) -> str:
    """An article page of `site` with its boilerplate around the paragraphs."""
    nav = "".join(f'<li><a href="/section-{i}">Section {i}</a></li>' for i in range(links))
    related = "".join(f'<li><a href="/post-{i}">Related post number {i}</a></li>' for i in range(links))
    body = "".join(f"<p>{html.escape(p)}</p>" for p in paragraphs)
    return (
        f'<!DOCTYPE html><html lang="{language}"><head><meta charset="utf-8"><title>{html.escape(title)}'
        f" | {site}</title><style>body{{font-family:sans-serif}} .nav li{{display:inline}}</style>"
        "<script>window.dataLayer=window.dataLayer||[];function gtag(){dataLayer.push(arguments)}</script>"
        f'</head><body><header><div class="logo">{site}</div><nav class="nav"><ul>{nav}</ul></nav></header>'
        '<div class="cookie-banner">We use cookies to improve your experience. Accept all cookies?</div>'
        f"<main><article><h1>{html.escape(title)}</h1>{body}</article></main>"
        f'<aside class="sidebar"><h3>Related</h3><ul>{related}</ul></aside>'
        f'<footer><p>Copyright 2024 {site}. All rights reserved.</p><a href="/privacy">Privacy</a> '
        '<a href="/terms">Terms of use</a></footer></body></html>'
    )


def write_warc(path: str, pages: Iterable[Page], gzip: bool = True) -> list[int]:
    """Write the pages as one WARC file (a warcinfo record first); returns each page's record offset."""
    offsets = []
    with open(path, "wb") as out:
        writer = WARCWriter(out, gzip=gzip)
        writer.write_record(writer.create_warcinfo_record(path, {"software": "megatron-flow tests"}))
        for number, page in enumerate(pages):
            offsets.append(out.tell())
            headers = {
                "WARC-Date": WARC_DATE,
                "WARC-Record-ID": f"<urn:uuid:{number:08d}-0000-4000-8000-{number:012d}>",
            }
            if page.record_type == "response":
                http = StatusAndHeaders("200 OK", [("Content-Type", page.content_type)], protocol="HTTP/1.1")
                record = writer.create_warc_record(
                    page.url,
                    "response",
                    payload=io.BytesIO(page.body),
                    http_headers=http,
                    warc_headers_dict=headers,
                )
            else:
                record = writer.create_warc_record(
                    page.url,
                    page.record_type,
                    payload=io.BytesIO(page.body),
                    warc_content_type=page.content_type,
                    warc_headers_dict=headers,
                )
            writer.write_record(record)
    return offsets


def good_chapters(count: int) -> list[str]:
    """Chapters whose page passes every quality rule, FineWeb's included, once extracted: the kept pages."""
    from stages.clean import CleanParams, clean_text
    from stages.extract import extract_main_text
    from stages.quality_filters import first_failing_rule

    params = CleanParams(fineweb=True)
    chosen = []
    for number, chapter in enumerate(kjv_chapters()):
        page = html_page(f"Chapter {number}", chapter.split("\n"), "check.example")
        text = clean_text(extract_main_text(page, "resiliparse"), params)
        if 300 < len(text.split()) < 900 and first_failing_rule(text, params) is None:
            chosen.append(chapter)
            if len(chosen) == count:
                return chosen
    raise AssertionError("not enough clean chapters in the embedded corpus")


def random_passages(count: int, words: int, seed: int) -> list[str]:
    """Evaluation-set passages no chapter contains: random words of the English chapters' vocabulary."""
    rng = random.Random(seed)
    vocabulary = sorted({w.strip(".,;:?!()'").lower() for c in kjv_chapters()[:50] for w in c.split()} - {""})
    passages = []
    for _ in range(count):
        text = " ".join(rng.choice(vocabulary) for _ in range(words))
        passages.append(text[0].upper() + text[1:] + ".")
    return passages


@dataclass
class Crawl:
    """A crawl folder the tests wrote, with what each page must become (`fate`: url -> the reason it is
    dropped with, or "kept")."""

    folder: str  # the WARC and the WET file; the other files lie beside it
    warc: str
    wet: str
    domains: str
    lambada: str
    wikitext: str
    fate: dict[str, str]
    bad_offsets: dict[str, list[int]]
    records: int  # WARC records written, warcinfo records included


def write_crawl(root: str, good: int = 8) -> Crawl:
    """`root/crawl/`: a WARC and a WET file with a page for every step's every reason; beside it the files the
    flags name (domains.txt, lambada_test.jsonl, wiki.test.tokens)."""
    import os

    folder = os.path.join(root, "crawl")
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(0)
    chapters = good_chapters(good + 6)
    lambada = random_passages(3, 60, seed=1)
    wiki_paragraph = random_passages(1, 40, seed=2)[0]
    pages: list[Page] = []
    fate: dict[str, str] = {}

    def add(url: str, paragraphs: list[str], reason: str, language: str = "en") -> None:
        pages.append(
            Page(url, html_page(url.rsplit("/", 1)[-1], paragraphs, url.split("/")[2], language).encode())
        )
        fate[url] = reason

    def verses(chapter: str) -> list[str]:
        return chapter.split("\n")

    for i in range(good):
        add(
            f"http://{('news.example', 'blog.internal', 'notspam.example')[i % 3]}/article-{i}",
            verses(chapters[i]),
            "kept",
        )
    extra = iter(chapters[good:])
    # URL filter: a listed domain and two of its subdomains (one with a port), a listed URL, a banned word.
    for url in ("http://spam.example/a", "https://www.spam.example/b", "http://cdn.ads.spam.example:8080/c"):
        add(url, verses(chapters[0]), "url_domain")
    add("http://blog.internal/secret.html", verses(chapters[1]), "url_listed")
    add("http://news.example/casino-bonus-today", verses(chapters[2]), "url_banned_word")
    # Extraction: a page of scripts and styles only.
    pages.append(
        Page(
            "http://news.example/app",
            b"<html><head><script>var a=1;</script></head><body>"
            b"<script>document.write('x')</script><style>p{}</style></body></html>",
        )
    )
    fate["http://news.example/app"] = "extracted_empty"
    # Language: German, French and Spanish articles.
    for language in ("de", "fr", "es", "de"):
        url = f"http://{language}.example/artikel-{len(fate)}"
        add(url, foreign_paragraphs(language, rng, 6), "language", language)
    # Decontamination: a whole LAMBADA passage, exactly 13 of its words, a WikiText paragraph; a 12-word
    # fragment is not a match.
    planted = verses(next(extra))
    add(
        "http://news.example/lambada-whole",
        planted[:5] + [lambada[0]] + planted[5:],
        "contaminated_lambada_test",
    )
    fragment = " ".join(lambada[1].split()[20:33])
    planted = verses(next(extra))
    add(
        "http://news.example/lambada-13",
        planted[:3] + [f"As they say, {fragment} indeed."] + planted[3:],
        "contaminated_lambada_test",
    )
    planted = verses(next(extra))
    add("http://blog.internal/wiki-copy", planted + [wiki_paragraph], "contaminated_wiki")
    near_miss = " ".join(lambada[2].split()[5:17])
    planted = verses(next(extra))
    add(
        "http://news.example/lambada-12",
        planted[:4] + [f"Some said {near_miss} and left."] + planted[4:],
        "kept",
    )
    # Quality: C4's lorem ipsum, FineWeb's short lines; PII in a page that is kept.
    add(
        "http://blog.internal/draft",
        verses(next(extra)) + ["Lorem ipsum dolor sit amet, consectetur."],
        "c4_lorem_ipsum",
    )
    vocabulary = " ".join(chapters[0].split("\n")).split()
    short = [" ".join(vocabulary[i : i + 4]).rstrip(".,;:") + "." for i in range(0, 320, 4)]
    add("http://news.example/list", short, "fineweb_short_lines")
    add(
        "http://news.example/contact",
        verses(next(extra))
        + ["Write to jane.doe@mail.example.com or john@corp.example.org, servers 8.8.8.8 and 192.168.1.20."],
        "kept",
    )
    # Download: an image, an empty page, a request record (not a page), a record damaged on disk.
    pages.append(Page("http://news.example/logo.png", b"\x89PNG\r\n\x1a\n" + bytes(range(64)), "image/png"))
    fate["http://news.example/logo.png"] = "non_html"
    pages.append(Page("http://news.example/empty", b"   "))
    fate["http://news.example/empty"] = "empty_page"
    pages.append(
        Page(
            "http://news.example/",
            b"GET / HTTP/1.1\r\nHost: news.example\r\n\r\n",
            "application/http; msgtype=request",
            "request",
        )
    )
    damaged_url = "http://news.example/damaged"
    add(damaged_url, verses(chapters[3]), "unparsable_record")
    add("http://news.example/after-damage", verses(chapters[4]), "kept")

    warc = os.path.join(folder, "crawl.warc.gz")
    offsets = write_warc(warc, pages)
    damaged = offsets[[p.url for p in pages].index(damaged_url)]
    with open(warc, "r+b") as f:  # garble the damaged record's gzip member after its header
        f.seek(damaged + 40)
        f.write(b"\x00" * 64)
    wet = os.path.join(folder, "crawl.wet.gz")
    write_warc(
        wet,
        [
            Page("http://wet.example/en", chapters[5].encode(), "text/plain", "conversion"),
            Page(
                "http://wet.example/de",
                "\n".join(foreign_paragraphs("de", rng, 5)).encode(),
                "text/plain",
                "conversion",
            ),
        ],
    )
    fate["http://wet.example/en"] = "kept"
    fate["http://wet.example/de"] = "language"
    paths = {
        name: os.path.join(root, name) for name in ("domains.txt", "lambada_test.jsonl", "wiki.test.tokens")
    }
    with open(paths["domains.txt"], "w") as f:
        f.write("# blocked hosts and pages\nspam.example\nhttp://blog.internal/secret.html\n\n")
    with open(paths["lambada_test.jsonl"], "w") as f:
        f.writelines(json.dumps({"text": passage}) + "\n" for passage in lambada)
    with open(paths["wiki.test.tokens"], "w") as f:  # WikiText-103's tokenisation: " @-@ ", " , ", " ."
        f.write(f" = Heading = \n\n {wiki_paragraph.replace(' ', ' @-@ ', 3).replace(',', ' ,')[:-1]} . \n")
    return Crawl(
        folder,
        warc,
        wet,
        paths["domains.txt"],
        paths["lambada_test.jsonl"],
        paths["wiki.test.tokens"],
        fate,
        {warc: [damaged]},
        1 + len(pages) + 1 + 2,
    )
