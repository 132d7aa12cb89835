"""Names a client such as OpenPipe ART sends for a project, a model or a ``run_name``, as stored.

ART accepts any string ("Odd one", "Run #2 (α)"); artweb stores slugs, which its URLs and model ids
(``project/model:step``) need. A name that is a slug is stored as it is; any other is mapped to a
slug that keeps its readable part and adds eight hex digits of its SHA-256, so two names never
share a stored one by accident. The mapping is a pure function of the name: the gateway resolves
``wandb-artifact:///<team>/<project>/<model>`` with it, and every reply to such a request names the
model as the client did.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

from projects.errors import ValidationFailed

SLUG = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
MAX_CLIENT_NAME = 200  # characters of a client's name: a title, not a document


def client_slug(name: str) -> str:
    """The stored slug of a client's name (see the module doc)."""
    if SLUG.fullmatch(name):
        return name
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode().lower()
    readable = re.sub(r"[^a-z0-9._-]+", "-", ascii_name).strip("-._")[:50].rstrip("-._") or "name"
    return f"{readable}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def check_client_name(value: object, field: str) -> str:
    """A client's name: a non-empty line of at most MAX_CLIENT_NAME characters, without '/' (it
    separates the parts of ART's inference names); ValidationFailed on ``field`` otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationFailed("must be a non-empty string", field=field)
    if len(value) > MAX_CLIENT_NAME:
        raise ValidationFailed(f"must be at most {MAX_CLIENT_NAME} characters", field=field)
    if "/" in value or any(unicodedata.category(c) == "Cc" for c in value):
        raise ValidationFailed("must be one line without '/'", field=field)
    return value
