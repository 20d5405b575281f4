"""Web archive input: the pages of WARC and WET files (Common Crawl's formats), streamed record by record.

`iter_warc_pages(url, stats)` reads one `.warc`, `.warc.gz`, `.wet` or `.wet.gz` file (local or any fsspec URL)
with warcio and yields `(offset, page)`: `page` has `id` (the WARC-Record-ID), `text` (the HTML of a response
record decoded to str, or the plain text of a WET conversion record), `url`, `date` and `content_type`. Only
HTML responses and WET conversions are pages; other responses (images, PDF, ...) and pages without content are
counted in `stats["dropped"]` (`non_html`, `empty_page`); request, metadata and warcinfo records are skipped.

A record that cannot be parsed (a damaged gzip member, a garbled header, a file cut short) is not fatal: its
offset is recorded in `stats["bad_offsets"]`, counted as `unparsable_record`, and reading resumes at the next
record start (the next gzip member, or the next `WARC/1.` header line of an uncompressed file).
"""

from __future__ import annotations

import codecs
import zlib
from collections.abc import Iterator
from typing import BinaryIO

import fsspec

WARC_SUFFIXES = (".warc", ".warc.gz", ".wet", ".wet.gz")
HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
SCAN_BYTES = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b\x08"
_WARC_LINE = b"\nWARC/1."


def is_warc(url: str) -> bool:
    return url.lower().endswith(WARC_SUFFIXES)


def new_warc_stats() -> dict:
    """The counts `iter_warc_pages` adds to: records read, pages dropped by reason, offsets of bad records."""
    return {
        "warc_records": 0,
        "dropped": {"non_html": 0, "empty_page": 0, "unparsable_record": 0},
        "bad_offsets": {},
    }


def _mime(value: str | None) -> str:
    return (value or "").split(";")[0].strip().lower()


def decode_html(payload: bytes, declared: str | None) -> str:
    """A page's bytes as text: UTF-8 when they are, else the HTTP header's charset, else the encoding
    resiliparse detects (never fails: undecodable bytes become U+FFFD)."""
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        pass
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    charset = None
    for part in (declared or "").split(";")[1:]:
        name, _, value = part.strip().partition("=")
        if name.lower() == "charset" and value:
            charset = value.strip("\"' ")
    try:
        codecs.lookup(charset or "")
    except LookupError:  # none given, or a name no codec has (charset=foo): what the bytes look like
        charset = detect_encoding(payload)
    return bytes_to_str(payload, charset)


def _page(record, stats: dict) -> dict | None:
    """The page of a response or conversion record, or None (counted when it is a dropped page)."""
    if record.rec_type not in ("response", "conversion"):
        return None
    headers = record.rec_headers
    if record.rec_type == "response":
        declared = record.http_headers.get_header("Content-Type") if record.http_headers else None
    else:
        declared = headers.get_header("Content-Type")
    mime = _mime(headers.get_header("WARC-Identified-Payload-Type") or declared)
    wanted = HTML_TYPES if record.rec_type == "response" else HTML_TYPES | {"text/plain"}
    payload = record.content_stream().read()
    if mime not in wanted:
        stats["dropped"]["non_html"] += 1
        return None
    text = decode_html(payload, declared) if mime in HTML_TYPES else payload.decode("utf-8", "replace")
    if not text.strip():
        stats["dropped"]["empty_page"] += 1
        return None
    record_id = headers.get_header("WARC-Record-ID") or ""
    return {
        "id": record_id.removeprefix("<urn:uuid:").removeprefix("<").removesuffix(">"),
        "text": text,
        "url": headers.get_header("WARC-Target-URI"),
        "date": headers.get_header("WARC-Date"),
        "content_type": mime,
    }


def _next_record_start(f: BinaryIO, position: int, gzipped: bool) -> int | None:
    """The first offset after `position` where a record may start (a gzip member's magic bytes, or a line
    `WARC/1.` of an uncompressed file); None at the end of the file."""
    marker = _GZIP_MAGIC if gzipped else _WARC_LINE
    f.seek(position)
    carry = b""
    start = position
    while True:
        block = f.read(SCAN_BYTES)
        if not block:
            return None
        data = carry + block
        found = data.find(marker)
        if found >= 0:
            return start + found + (0 if gzipped else 1)  # after the newline that precedes WARC/1.
        keep = len(marker) - 1
        carry = data[-keep:]
        start += len(data) - len(carry)


def iter_warc_pages(url: str, stats: dict, **storage_options) -> Iterator[tuple[int, dict]]:
    """(record offset, page) of every HTML response and WET conversion record of one WARC/WET file."""
    from warcio.archiveiterator import ArchiveIterator
    from warcio.exceptions import ArchiveLoadFailed
    from warcio.statusandheaders import StatusAndHeadersParserException

    bad: list[int] = stats["bad_offsets"].setdefault(url, [])
    with fsspec.open(url, "rb", **storage_options) as f:
        gzipped = url.lower().endswith(".gz")
        start, resumed = 0, False
        while start is not None:
            f.seek(start)
            records = ArchiveIterator(f)
            try:
                for record in records:
                    if record.rec_type is None:  # what warcio makes of a record cut short by the file's end
                        bad.append(records.get_record_offset())
                        stats["dropped"]["unparsable_record"] += 1
                        continue
                    page = _page(record, stats)  # reads the record: warcio finds its offset after that
                    stats["warc_records"] += 1
                    resumed = False
                    if page is not None:
                        yield records.get_record_offset(), page
                return
            except (ArchiveLoadFailed, StatusAndHeadersParserException, zlib.error, EOFError, ValueError):
                failed = max(records.offset, start)  # warcio counts from the start of the file
                if not (resumed and failed == start):  # a false record start inside a bad region: same record
                    bad.append(failed)
                    stats["dropped"]["unparsable_record"] += 1
                    resumed = True
                start = _next_record_start(f, failed + 1, gzipped)
