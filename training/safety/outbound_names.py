"""Host names and URLs as outbound calls carry them, and the refusal every check raises: the floor
under training.safety.outbound (the policy) and training.safety.outbound_transport (its connections), which both
use them."""

from __future__ import annotations

import re
from urllib.parse import quote, urlsplit, urlunsplit

import idna


class OutboundRefused(ValueError):
    """The policy refuses this URL or address; the message says why (for people, no secret).
    ``allow_entry``: for a host refused only for being internal (loopback, private, …; never cloud
    metadata), the allow-list entry that would admit it (``127.0.0.1:8000``), else None."""

    def __init__(self, message: str, *, allow_entry: str | None = None) -> None:
        super().__init__(message)
        self.allow_entry = allow_entry


def normalise_host(host: str) -> str:
    """A host as compared and resolved: lower case, IDNA, without brackets or a trailing dot (which
    would otherwise slip ``metadata.google.internal.`` past a name check)."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if any(ord(char) < 0x21 or char in "\x7f\\" for char in host):  # C would cut at a NUL
        raise OutboundRefused("the host is not a valid name")
    if host and not host.isascii():
        host = idna_host(host)
    return host


def idna_host(host: str) -> str:
    """An internationalised host name in its ASCII form (IDNA 2008 with UTS 46 mapping: lower case,
    ``。`` as a dot); OutboundRefused saying why when it is not a valid one (a label over 63
    characters, a code point IDNA 2008 disallows such as ``☃``). One function for the check, the
    stored URL and the connection, so that all three agree on the name."""
    try:
        return idna.encode(host, uts46=True).decode("ascii")
    except (idna.IDNAError, UnicodeError) as exc:  # the message names the label, never more
        raise OutboundRefused(f"the host is not a valid name (IDNA: {exc})") from None


def ascii_url(url: str) -> str:
    """``url`` as HTTP can carry it: a non-ASCII host name IDNA-encoded (``https://例え.テスト/v1`` →
    ``https://xn--r8jz45g.xn--zckzah/v1``) and any other non-ASCII character percent-encoded as
    UTF-8. http.client writes the Host header in Latin-1 and the request line in ASCII, so a URL kept
    as typed raises UnicodeEncodeError at every call. Every URL write stores this form (a team sees
    what is called); the opener applies it again to rows stored before. An ASCII URL comes back
    unchanged. OutboundRefused when the host is not a valid IDNA name."""
    if url.isascii():
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # a bad IPv6 literal, a netloc that NFKC turns into "/" or "@"
        raise OutboundRefused("must be an http:// or https:// URL with a valid host and port") from None
    userinfo, at, host_port = parts.netloc.rpartition("@")
    host, colon, port = host_port, "", ""
    if not host_port.startswith("["):  # an IPv6 literal's colons are not the port's
        host, colon, port = host_port.partition(":")
    if not port.isascii() or (host.startswith("[") and not host.isascii()):
        raise OutboundRefused("must be an http:// or https:// URL with a valid host and port")
    if not host.isascii():
        host = idna_host(host)
    netloc = f"{_percent_encoded(userinfo)}{at}{host}{colon}{port}"
    return urlunsplit(
        parts._replace(
            netloc=netloc,
            path=_percent_encoded(parts.path),
            query=_percent_encoded(parts.query),
            fragment=_percent_encoded(parts.fragment),
        )
    )


def _percent_encoded(text: str) -> str:
    """Only the non-ASCII runs encoded: what was ASCII (escapes included) stays as it was written."""
    return re.sub(r"[^\x00-\x7f]+", lambda match: quote(match.group(), safe=""), text)
