"""API key authentication (``Authorization: Bearer aw_…``).

Which team the key (or a signed-in person) acts for is decided in ``projects.access``, called once
per request by ``projects.api.base``; views never pick a team themselves.
"""

from __future__ import annotations

from rest_framework import authentication, exceptions
from rest_framework.request import Request

from projects import body_limits, services
from projects.models import ApiKey


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request):
        header = authentication.get_authorization_header(request).decode(errors="replace")
        if not header:
            return None
        parts = header.split()
        if len(parts) != 2 or parts[0] != self.keyword:
            raise exceptions.AuthenticationFailed("use 'Authorization: Bearer <api key>'")
        # The ASGI gate (projects.body_limits) may have looked this key up for this request already.
        api_key = body_limits.verified_key(getattr(request._request, "scope", None), parts[1])
        if api_key is None:
            api_key = services.api_key_authenticate(raw=parts[1])
        if api_key is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
        return (ApiKeyUser(api_key), api_key)

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class ApiKeyUser:
    """The principal of a key-authenticated request (keys belong to teams, not people)."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    pk = None
    id = None

    def __init__(self, api_key: ApiKey) -> None:
        self.api_key = api_key

    def __str__(self) -> str:
        return f"api-key:{self.api_key.prefix}"
