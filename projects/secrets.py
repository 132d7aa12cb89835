"""Encryption at rest for third-party secrets a team stores with us (judge endpoint API keys).

Fernet (AES-128-CBC + HMAC) with a key derived from SECRET_KEY; rotating SECRET_KEY makes stored
secrets unreadable (they must be entered again), which is the safe failure.
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings


def _fernet() -> Fernet:
    digest = hashlib.sha256(b"artweb-secrets-v1:" + settings.SECRET_KEY.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def encrypt(plaintext: str) -> str:
    return _fernet().encrypt(plaintext.encode()).decode() if plaintext else ""


def decrypt(token: str) -> str:
    if not token:
        return ""
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken as exc:
        raise ValueError("stored secret cannot be decrypted (was SECRET_KEY changed?)") from exc
