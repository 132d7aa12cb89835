"""The operator's outbound-URL policy (``training.safety.outbound``) for every call the platform makes on a
team's behalf: judge graders, remote references, scenario generation, MCP servers over HTTP.

Every URL write stores the URL as it is called (an internationalised host name IDNA-encoded, so
the row and the Host header agree). Input and use are checked by the same policy: a forbidden URL
is a 400 naming its field when a judge endpoint or an environment is written, and refused again at
every connection (a name may resolve differently later), so a row stored before the policy or a
rebinding DNS name reaches nothing.
"""

from __future__ import annotations

from django.conf import settings

from projects.errors import ValidationFailed
from training.safety.outbound import OutboundPolicy, OutboundRefused, ascii_url


def outbound_policy() -> OutboundPolicy:
    """The policy from the ``OUTBOUND_ALLOW`` setting (public addresses, plus the operator's hosts
    and networks)."""
    return OutboundPolicy(allow=tuple(settings.OUTBOUND_ALLOW))


def outbound_url_checked(url: str, *, field: str, max_length: int | None = None) -> str:
    """``url`` as stored and called (``training.safety.outbound.ascii_url``: an internationalised host
    IDNA-encoded); ValidationFailed on ``field`` with the reason when it is no valid IDNA name, when
    the policy refuses it (a name that does not resolve now passes: it is checked again when it is
    called), or when the encoded form outgrows the column (``max_length``)."""
    try:
        url = ascii_url(url)
        outbound_policy().check_url(url)
    except OutboundRefused as exc:
        raise ValidationFailed(refusal_text(exc), field=field) from exc
    if max_length is not None and len(url) > max_length:
        raise ValidationFailed(
            f"must be at most {max_length} characters once encoded for HTTP (IDNA host, %-escapes)",
            field=field,
        )
    return url


def refusal_text(exc: OutboundRefused) -> str:
    """The policy's reason and, for an internal address an operator may allow, how: a team saw
    "only public addresses may be called" for its loopback judge and no way forward (issue 24)."""
    if exc.allow_entry is None:
        return str(exc)
    return (
        f"{exc}; an operator allows it by adding {exc.allow_entry} to the OUTBOUND_ALLOW setting "
        "(comma-separated hosts, addresses or CIDRs, each with an optional :port) and restarting"
    )
