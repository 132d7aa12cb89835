"""Third-party secrets a team stores with us (judge endpoint API keys, MCP headers; later webhook
and storage credentials): encryption at rest, and the two rules for the URLs they are sent to.

Fernet (AES-128-CBC + HMAC) with a key derived from SECRET_KEY; rotating SECRET_KEY makes stored
secrets unreadable (they must be entered again), which is the safe failure.

Safety invariant: a stored secret is sent only to the URL it was entered with. Whoever changes that
URL gives the secret again (``secret_follows_url``), so a caller who can edit a row but never read
its secret cannot redirect the secret to a host of their choosing. And no stored URL carries a
credential of its own (``url_credentials_refused``): those would be shown to every reader.
"""

from __future__ import annotations

import base64
import hashlib
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings
from django.views.decorators.debug import sensitive_variables

from projects.errors import ValidationFailed

MASK = "********"


def _fernet() -> Fernet:
    digest = hashlib.sha256(b"artweb-secrets-v1:" + settings.SECRET_KEY.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


# sensitive_variables: an error report (the DEBUG page included, artweb.error_reports) never shows
# a plaintext secret held by these frames or the frames they call.
@sensitive_variables("plaintext")
def encrypt(plaintext: str) -> str:
    return _fernet().encrypt(plaintext.encode()).decode() if plaintext else ""


@sensitive_variables()  # all: the frames below it hold the plaintext
def decrypt(token: str) -> str:
    if not token:
        return ""
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken as exc:
        raise ValueError("stored secret cannot be decrypted (was SECRET_KEY changed?)") from exc


def secret_follows_url(
    *,
    stored_url: str,
    url: str,
    has_stored_secret: bool,
    secret_given: bool,
    url_field: str,
    secret_field: str,
    empty: str = '""',
) -> None:
    """The one rule for every row that holds a URL and a secret for it: a write that changes the URL
    while a secret is stored must give the secret again (an explicitly ``empty`` value drops it).
    Raises ValidationFailed naming ``secret_field`` otherwise."""
    if url != stored_url and has_stored_secret and not secret_given:
        raise ValidationFailed(
            f"{url_field} changed: give {secret_field} again (a stored secret is sent only to the "
            f"URL it was entered for; {empty} for none)",
            field=secret_field,
        )


# A query parameter whose name is, contains as a word, or ends in one of these carries a credential.
_CREDENTIAL_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "password", "passwd", "pwd", "pass", "sig", "signature"}
    | {"auth", "authorization", "credential", "credentials", "session", "sessionid", "jwt", "bearer"}
)
_CREDENTIAL_SUFFIXES = ("key", "token", "secret", "password", "signature", "credential", "credentials")


def _is_credential_name(name: str) -> bool:
    lowered = name.lower()
    words = {word for word in re.split(r"[^a-z0-9]+", lowered) if word}
    collapsed = re.sub(r"[^a-z0-9]", "", lowered)
    return (
        bool(words & _CREDENTIAL_WORDS)
        or collapsed in _CREDENTIAL_WORDS
        or collapsed.endswith(_CREDENTIAL_SUFFIXES)
    )


def url_credentials_refused(url: str, *, field: str) -> None:
    """Refuse a URL that carries a credential: userinfo (``user:pw@host``) or a query parameter
    named like one (``?api_key=``, ``?token=``, ``?sig=`` …). Secrets belong in the row's secret
    field (encrypted, write-only), never in a URL that the API and the dashboard show. Called for
    every stored URL, beside (not inside) the outbound-address policy."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return  # not a URL at all: the field's own validation names it
    if "@" in parts.netloc:
        raise ValidationFailed(
            "must not contain a user name or password (user:password@host); give the secret in its own field",
            field=field,
        )
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if _is_credential_name(name):
            raise ValidationFailed(
                f"must not carry a credential in the query string ({name}=…); give the secret in its own field",
                field=field,
            )


def url_public(url: str) -> str:
    """``url`` as shown to any reader: userinfo and credential-named query values masked. New
    writes refuse both (``url_credentials_refused``); this covers rows stored before that rule."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc, query = parts.netloc, parts.query
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rsplit('@', 1)[1]}"
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(_is_credential_name(name) for name, _ in pairs):
        query = urlencode(
            [(name, MASK if _is_credential_name(name) else value) for name, value in pairs], safe="*"
        )
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))
