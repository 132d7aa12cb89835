"""The operator's outbound-URL policy (``training.outbound``) for every call the platform makes on a
team's behalf: judge graders, remote references, scenario generation, MCP servers over HTTP.

Input and use are checked by the same policy: a forbidden URL is a 400 naming its field when a judge
endpoint or an environment is written, and refused again at every connection (a name may resolve
differently later), so a row stored before the policy or a rebinding DNS name reaches nothing.
"""

from __future__ import annotations

from django.conf import settings

from projects.errors import ValidationFailed
from training.outbound import OutboundPolicy, OutboundRefused


def outbound_policy() -> OutboundPolicy:
    """The policy from the ``OUTBOUND_ALLOW`` setting (public addresses, plus the operator's hosts
    and networks)."""
    return OutboundPolicy(allow=tuple(settings.OUTBOUND_ALLOW))


def outbound_url_checked(url: str, *, field: str) -> None:
    """ValidationFailed on ``field`` with the reason when the policy refuses ``url`` (a name that
    does not resolve now passes: it is checked again when it is called)."""
    try:
        outbound_policy().check_url(url)
    except OutboundRefused as exc:
        raise ValidationFailed(str(exc), field=field) from exc
