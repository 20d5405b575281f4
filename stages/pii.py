"""PII replacement of the clean stage: e-mail addresses and public IP addresses, as datatrove's `PIIFormatter`.

The same patterns and the same replacements, used in turn (the first address found gets the first replacement,
the next the second, ...). datatrove keeps its turn across documents, so a document's text would depend on the
documents its worker saw before; here the turn starts again with each document, so text depends on itself alone.
Only IP addresses that are globally routable are replaced (not 10.x, 127.x, 192.168.x, ...).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

EMAIL = re.compile(
    r"\b[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@(?:(?:[A-Za-z0-9](?:["
    r"A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?|\[(?:(?:25[0-5]|2[0-4][0-9]|["
    r"01]?[0-9][0-9]?)\.){3}(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?|[A-Za-z0-9-]*[A-Za-z0-9]:)])"
)
IPV4 = re.compile(
    r"(?:(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)"
)
EMAIL_REPLACEMENTS = ("email@example.com", "firstname.lastname@example.org")
IP_REPLACEMENTS = (
    "22.214.171.124",
    "126.96.36.199",
    "188.8.131.52",
    "184.108.40.206",
    "220.127.116.11",
    "18.104.22.168",
)


def _is_public_ip(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).is_global
    except ValueError:
        return False


def _replace(
    pattern: re.Pattern, replacements: tuple[str, ...], text: str, keep: Callable[[str], bool] | None = None
) -> tuple[str, int]:
    turn = 0

    def replacement(match: re.Match) -> str:
        nonlocal turn
        if keep is not None and keep(match.group()):
            return match.group()
        turn += 1
        return replacements[(turn - 1) % len(replacements)]

    return pattern.sub(replacement, text), turn


def replace_pii(text: str) -> tuple[str, int, int]:
    """(text with e-mail and public IP addresses replaced, e-mails replaced, IPs replaced)."""
    text, emails = _replace(EMAIL, EMAIL_REPLACEMENTS, text)
    text, ips = _replace(IPV4, IP_REPLACEMENTS, text, keep=lambda ip: not _is_public_ip(ip))
    return text, emails, ips
