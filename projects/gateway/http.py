"""A small HTTP/1.1 client over asyncio streams, for gateway -> inference server calls (what the
two dialects in projects.gateway.upstream and projects.gateway.vllm send their requests with).

Why not a library: the web process has no async HTTP client among its dependencies, and the
servers are our own (uvicorn/h11), so the client needs little: keep-alive reuse, Content-Length
and chunked bodies, and reading a stream chunk by chunk so it can be relayed as it arrives.

Invariants: a connection returns to the pool only after its response was read to the end; any
error or an abandoned body closes it. A request that fails before any response byte arrives on a
*reused* connection is retried once on a fresh one (the server may have just closed the idle
connection); failing to connect raises UpstreamUnavailable, so the caller can try another server.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit


class UpstreamUnavailable(Exception):
    """Nothing was received from the server: another server may be tried."""


class UpstreamBroken(Exception):
    """The server failed mid-response (or timed out)."""


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    def __init__(
        self, pool: UpstreamPool, key: tuple[str, int], connection: _Connection, status: int,
        headers: dict[str, str], timeout: float,
    ) -> None:  # fmt: skip
        self.status = status
        self.headers = headers
        self._pool, self._key, self._connection, self._timeout = pool, key, connection, timeout
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._length = int(length) if length is not None and not self._chunked else None
        self._keep = headers.get("connection", "").lower() != "close"
        self._finished = False

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as the server sent it: one item per HTTP chunk for chunked bodies."""
        reader = self._connection.reader
        try:
            if self._chunked:
                while True:
                    async with asyncio.timeout(self._timeout):
                        line = await reader.readline()
                        if not line:
                            raise UpstreamBroken("the server closed the connection mid-response")
                        size = int(line.split(b";", 1)[0].strip(), 16)
                        if size == 0:
                            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            break
                        data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._length is not None:
                remaining = self._length
                while remaining:
                    async with asyncio.timeout(self._timeout):
                        data = await reader.read(min(remaining, 1 << 16))
                    if not data:
                        raise UpstreamBroken("the server closed the connection mid-response")
                    remaining -= len(data)
                    yield data
            else:
                self._keep = False  # delimited by the connection closing
                while True:
                    async with asyncio.timeout(self._timeout):
                        data = await reader.read(1 << 16)
                    if not data:
                        break
                    yield data
            self._finished = True
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            raise UpstreamBroken(f"the response broke off: {exc!r}") from exc
        finally:
            self.release()

    def release(self) -> None:
        """Give the connection back (body fully read) or close it; idempotent."""
        if self._connection is None:
            return
        if self._finished and self._keep:
            self._pool._put(self._key, self._connection)
        else:
            self._connection.close()
        self._connection = None  # type: ignore[assignment]


class UpstreamPool:
    def __init__(
        self, *, connect_timeout: float = 2.0, idle_s: float = 30.0, max_idle_per_server: int = 64
    ) -> None:
        self.connect_timeout = connect_timeout
        self.idle_s = idle_s  # below the servers' keep-alive timeout (75 s)
        self.max_idle_per_server = max_idle_per_server
        self._idle: defaultdict[tuple[str, int], list[_Connection]] = defaultdict(list)

    async def request(
        self, url: str, path: str, *, method: str = "POST", headers: dict[str, str] | None = None,
        body: bytes = b"", timeout: float = 600.0,
    ) -> UpstreamResponse:  # fmt: skip
        """Send a request to the server at base ``url``; returns once the status and headers are in."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise UpstreamUnavailable(f"unsupported server URL {url!r} (http://host:port expected)")
        host, port = parts.hostname, parts.port or 80
        key = (host, port)
        head = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(body)}"]
        head += [f"{name}: {value}" for name, value in (headers or {}).items()]
        payload = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        for _ in range(2):
            connection, reused = await self._get(key)
            try:
                connection.writer.write(payload)
                await connection.writer.drain()
                async with asyncio.timeout(timeout):
                    raw = await connection.reader.readuntil(b"\r\n\r\n")
            except TimeoutError as exc:
                connection.close()
                raise UpstreamBroken(f"no response within {timeout:g} s") from exc
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as exc:
                connection.close()
                if reused:
                    continue
                raise UpstreamUnavailable(f"{url}: {exc!r}") from exc
            status, response_headers = _parse_head(raw)
            return UpstreamResponse(self, key, connection, status, response_headers, timeout)
        raise UpstreamUnavailable(f"{url}: the connection was closed twice before a response")

    async def _get(self, key: tuple[str, int]) -> tuple[_Connection, bool]:
        idle = self._idle[key]
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if (
                now - connection.idle_since < self.idle_s
                and not connection.reader.at_eof()
                and not connection.writer.is_closing()
            ):
                return connection, True
            connection.close()
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(*key)
        except (TimeoutError, OSError) as exc:
            raise UpstreamUnavailable(f"cannot connect to {key[0]}:{key[1]}: {exc!r}") from exc
        return _Connection(reader, writer), False

    def _put(self, key: tuple[str, int], connection: _Connection) -> None:
        idle = self._idle[key]
        if len(idle) >= self.max_idle_per_server or connection.writer.is_closing():
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError) as exc:
        raise UpstreamBroken(f"not an HTTP response: {lines[0][:80]!r}") from exc
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers


# Streams belong to the event loop that opened them: one pool per loop.
_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, UpstreamPool] = weakref.WeakKeyDictionary()


def pool() -> UpstreamPool:
    loop = asyncio.get_running_loop()
    found = _pools.get(loop)
    if found is None:
        found = _pools[loop] = UpstreamPool()
    return found
