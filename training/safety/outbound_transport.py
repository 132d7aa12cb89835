"""The urllib and httpx plumbing of training.safety.outbound's policy: connections whose socket comes from
``OutboundPolicy.create_connection`` (resolved once, every address checked), URLs made ASCII
before urllib derives the Host header, redirects refused, and an httpcore network backend that
connects only to checked addresses."""

from __future__ import annotations

import contextlib
import http.client
import socket
import urllib.request
from typing import TYPE_CHECKING, Any

from training.safety.outbound_names import OutboundRefused, ascii_url

if TYPE_CHECKING:
    from training.safety.outbound import OutboundPolicy


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP connection whose socket comes from the policy (no proxy tunnel: proxies are off)."""

    outbound_policy: OutboundPolicy

    def connect(self) -> None:
        self.sock = self.outbound_policy.create_connection(
            (self.host, self.port), self.timeout, getattr(self, "source_address", None)
        )
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _PinnedHTTPSConnection(http.client.HTTPSConnection, _PinnedConnection):
    """HTTPSConnection.connect calls super().connect() (here: _PinnedConnection's) and then wraps
    the socket with TLS for ``self.host``, the name: certificate and SNI checks are by name."""


def _pinned(connection_class: type[_PinnedConnection], policy: OutboundPolicy) -> Any:
    """What urllib's do_open calls as ``http_class(host, timeout=..., **kwargs)``."""

    def connection(host: str, **kwargs: Any) -> _PinnedConnection:
        made = connection_class(host, **kwargs)
        made.outbound_policy = policy
        return made

    return connection


def _ascii_request(req: urllib.request.Request) -> urllib.request.Request:
    """The request with its URL in ASCII (``ascii_url``) before urllib derives the Host header
    from it: a row stored before writes were normalised is called, or refused with
    OutboundRefused, instead of raising UnicodeEncodeError inside http.client."""
    url = ascii_url(req.full_url)
    if url != req.full_url:
        req.full_url = url  # the setter parses again: host and selector follow
    return req


class PinnedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, policy: OutboundPolicy) -> None:
        super().__init__()
        self.policy = policy

    def http_request(self, req: urllib.request.Request) -> urllib.request.Request:
        return super().http_request(_ascii_request(req))

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_pinned(_PinnedConnection, self.policy), req)


class PinnedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, policy: OutboundPolicy) -> None:
        super().__init__()
        self.policy = policy

    def https_request(self, req: urllib.request.Request) -> urllib.request.Request:
        return super().https_request(_ascii_request(req))

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_pinned(_PinnedHTTPSConnection, self.policy), req)


class RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Returning None makes urllib raise the 3xx as an HTTPError instead of following it."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


class PinnedAsyncBackend:
    """An httpcore network backend that resolves and checks the host through the policy, then
    connects to the checked address; everything else is the wrapped backend's."""

    def __init__(self, policy: OutboundPolicy, inner: Any) -> None:
        self.policy = policy
        self.inner = inner

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> Any:
        import anyio.to_thread

        addresses = await anyio.to_thread.run_sync(self.policy.resolve, host, port)
        error: Exception | None = None
        for _, sockaddr in addresses:
            try:
                return await self.inner.connect_tcp(
                    sockaddr[0],
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except Exception as exc:  # httpcore.ConnectError / ConnectTimeout: try the next address
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> Any:
        raise OutboundRefused("unix sockets are not reachable from a team's URL")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)
