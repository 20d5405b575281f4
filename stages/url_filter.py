"""URL filter of the clean stage: domain and URL blocklists from user files, banned words in URLs.

As datatrove's `URLFilter` and Megatron-LM's `tools/openwebtext/blacklist_urls.py`, with one difference on
purpose: a domain entry matches its host and every subdomain label by label (`example.com` blocks
`example.com` and `www.a.example.com`, not `badexample.com`), with no public-suffix list, so hosts under
suffixes the list does not know (`.example`, `.internal`, a bare `localhost`, an IP address) match too.

A blocklist file has one entry a line: a URL (it has `://`) is matched exactly, anything else is a domain;
blank lines and lines starting with `#` are skipped. Banned words are matched against the URL's lower-cased
alphanumeric words. The reasons, in the order they are checked: `url_domain`, `url_listed`, `url_banned_word`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import fsspec

REASONS = ("url_domain", "url_listed", "url_banned_word")
_URL_WORD_SEPARATOR = re.compile(r"[^a-z0-9]+")
_DOMAIN = re.compile(r"^[a-z0-9_-]+(\.[a-z0-9_-]+)*$|^\[?[0-9a-f:.]+\]?$")


def url_host(url: str) -> str:
    """The lower-case host of a URL, without port, brackets or trailing dot ('' when it has none)."""
    try:
        return (urlsplit(url.strip()).hostname or "").rstrip(".")
    except ValueError:  # a malformed URL (an unclosed IPv6 bracket, ...) has no host to match
        return ""


def url_words(url: str) -> set[str]:
    return set(_URL_WORD_SEPARATOR.split(url.lower())) - {""}


@dataclass(frozen=True)
class UrlBlocklist:
    """What the URL filter drops: domains (with their subdomains), exact URLs, words in URLs."""

    domains: frozenset[str] = frozenset()
    urls: frozenset[str] = frozenset()
    banned_words: frozenset[str] = frozenset()

    def reason(self, url: str) -> str | None:
        """The reason the filter drops `url`, or None when it passes."""
        labels = url_host(url).split(".")
        if any(".".join(labels[i:]) in self.domains for i in range(len(labels))):
            return "url_domain"
        if url.strip() in self.urls:
            return "url_listed"
        if not self.banned_words.isdisjoint(url_words(url)):
            return "url_banned_word"
        return None

    def to_json(self) -> dict:
        return {name: sorted(getattr(self, name)) for name in ("domains", "urls", "banned_words")}

    @classmethod
    def from_json(cls, data: dict) -> UrlBlocklist:
        return cls(**{name: frozenset(values) for name, values in data.items()})


def read_blocklists(files: Iterable[str], banned_words: Iterable[str], flag: str) -> UrlBlocklist:
    """The blocklist of the given files (local or fsspec URLs) and banned words; a line that is neither a URL nor
    a domain is an error naming the file, the line and `flag`."""
    domains: set[str] = set()
    urls: set[str] = set()
    for path in files:
        try:
            with fsspec.open(path, "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            raise FileNotFoundError(f"{flag}: {path}: no such file") from None
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{flag}: {path}: not UTF-8 text ({error.reason} at byte {error.start})"
            ) from None
        for number, raw in enumerate(lines, 1):
            entry = raw.strip()
            if not entry or entry.startswith("#"):
                continue
            if "://" in entry:
                urls.add(entry)
                continue
            domain = entry.lower().removeprefix("*.").strip(".")
            if not _DOMAIN.match(domain):
                raise ValueError(
                    f"{flag}: {path}:{number}: {raw.strip()!r} is neither a domain (example.com) nor a URL "
                    "(http://example.com/page); one entry a line, comment lines start with #"
                )
            domains.add(domain.strip("[]"))
    words = {w for word in banned_words for w in url_words(word)}
    return UrlBlocklist(frozenset(domains), frozenset(urls), frozenset(words))
