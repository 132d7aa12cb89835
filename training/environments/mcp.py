"""`mcp`: tools from a Model Context Protocol server, over stdio (a command) or streamable HTTP (a URL).

    {"kind": "mcp", "tools": ["search_products"], "max_turns": 4,
     "config": {"command": ["python", "-m", "training.environments.mcp_demo.server"]}}
    {"kind": "mcp", "config": {"url": "https://mcp.example.com/mcp", "headers": {"Authorization": "..."}}}

The session opens on first use (the first episode, or `environment.tools`): the server's tools
are listed then and shown to the model in the chat template's tool format; `tools` (optional)
keeps only the named ones. Each call has the environment's `tool_timeout_s`; a server error, a
tool error (`isError`) or a timeout comes back to the model as a tool result `{"error": ...}`.
`close()` ends the session (and a stdio server's process).

Concurrency invariant: the `mcp` client is async (anyio) and its transports must be entered and
left by one task. One background thread runs an event loop with one task that owns the whole
session; the sync agent loop submits calls to it with `run_coroutine_threadsafe` and waits with a
timeout, so a hung server can delay a turn by at most the tool timeout, never block it forever.

Safety: a stdio command runs a program on the worker, so only the shipped demo server
(`python -m training.environments.mcp_demo.server`, "python" meaning the worker's interpreter) and
programs in `allowed_programs` (the operator's list) are accepted. A URL is reached through the
`outbound` policy (``training.outbound``: public addresses only unless the operator allow-lists the
host; the connection goes to the checked address; redirects are not followed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
from contextlib import AsyncExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

from training.environments.base import (
    TOOL_CALLING_ANSWER,
    ConfigError,
    Environment,
    _object,
    _turns,
    known_keys,
    number,
)
from training.outbound import PUBLIC_ONLY, OutboundPolicy
from training.tools import Tool

DEMO_MODULE = "training.environments.mcp_demo.server"
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_HELP = {
    "command": f'stdio server: the command as a list, e.g. ["python", "-m", "{DEMO_MODULE}"]',
    "url": "streamable HTTP server: its URL, e.g. https://mcp.example.com/mcp (a public address, or a host the operator allows)",
    "env": "stdio server: extra environment variables (object of strings)",
    "headers": "HTTP server: extra request headers (object of strings)",
    "connect_timeout_s": "seconds to connect and list the tools (default 30)",
}


class MCPToolError(RuntimeError):
    """The server answered a call with an error (the model reads the message)."""


class MCPEnvironment(Environment):
    kind: ClassVar[str] = "mcp"
    description: ClassVar[str] = (
        "The model may call the tools of a Model Context Protocol server (stdio command or streamable "
        "HTTP URL), listed when the run starts; a turn without a tool call is its final answer."
    )
    answer: ClassVar[str] = TOOL_CALLING_ANSWER
    default_max_turns: ClassVar[int] = 4
    config_help: ClassVar[dict[str, str]] = CONFIG_HELP
    tools_help: ClassVar[str] = "names of the server's tools to expose; empty exposes all"

    def __init__(self, **settings: Any) -> None:
        self._tools: list[Tool] = []
        self._session: _Session | None = None
        self._lock = threading.Lock()
        self.tool_names: list[str] = settings.pop("tool_names", [])
        self.outbound: OutboundPolicy = settings.pop("outbound", PUBLIC_ONLY)
        super().__init__(**settings)

    @property  # type: ignore[override]
    def tools(self) -> list[Tool]:
        self.open()
        return self._tools

    @tools.setter
    def tools(self, value: list[Tool]) -> None:
        self._tools = value

    @classmethod
    def validate(
        cls, config: Any, tools: Any, max_turns: int | None, *, allowed_programs: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        config = _object(config, "config")
        known_keys(config, CONFIG_HELP)
        if ("command" in config) == ("url" in config):
            raise ConfigError("config", "give either config.command (stdio) or config.url (streamable HTTP)")
        if "command" in config:
            command = config["command"]
            if (
                not isinstance(command, list)
                or not command
                or not all(isinstance(p, str) and p for p in command)
            ):
                raise ConfigError("config.command", "must be a non-empty list of strings")
            if not stdio_allowed(command, allowed_programs):
                raise ConfigError(
                    "config.command",
                    f"only the demo server (python -m {DEMO_MODULE}) and programs the operator allows may run",
                )
        else:
            url = config["url"]
            parsed = urlparse(url) if isinstance(url, str) else None
            if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ConfigError("config.url", "must be an http:// or https:// URL")
        for key in ("env", "headers"):
            value = config.get(key, {})
            if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                raise ConfigError(f"config.{key}", "must be an object of strings")
        if "env" in config and "command" not in config:
            raise ConfigError("config.env", "only for a stdio server (config.command)")
        if "headers" in config and "url" not in config:
            raise ConfigError("config.headers", "only for an HTTP server (config.url)")
        number(config, "connect_timeout_s", 30.0, minimum=1)
        if tools is None:
            tools = []
        if not isinstance(tools, list) or not all(isinstance(name, str) and name for name in tools):
            raise ConfigError("tools", "must be a list of the server's tool names (empty: all)")
        return {"config": config, "tools": list(tools), "max_turns": _turns(max_turns, cls.default_max_turns)}

    @classmethod
    def tool_arguments(cls, tools: list[Any], config: dict[str, Any]) -> dict[str, Any]:
        return {"tool_names": list(tools)}  # the server's tools are listed when the session opens

    def open(self) -> None:
        """Connect and list the tools, once; raises if the server cannot be reached."""
        with self._lock:
            if self._session is not None:
                return
            session = _Session(self.config, self.outbound)
            try:
                listed = session.tools
                by_name = {tool.name: tool for tool in listed}
                missing = [name for name in self.tool_names if name not in by_name]
                if missing:
                    known = ", ".join(sorted(by_name)) or "none"
                    raise RuntimeError(f"the MCP server has no tool {', '.join(missing)} (it has: {known})")
                chosen = [by_name[name] for name in self.tool_names] if self.tool_names else listed
                self._tools = [self._tool(session, tool) for tool in chosen]
            except BaseException:
                session.close()
                raise
            self._session = session

    def close(self) -> None:
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close()

    def _tool(self, session: _Session, listed: Any) -> Tool:
        name = listed.name
        timeout_s = self.tool_timeout_s

        def call(**arguments: Any) -> Any:
            return session.call(name, arguments, timeout_s)

        schema = listed.inputSchema if isinstance(listed.inputSchema, dict) else {"type": "object"}
        return Tool(name, listed.description or "", schema, call)


def stdio_allowed(command: list[str], allowed_programs: tuple[str, ...]) -> bool:
    if command[0] in ("python", "python3", sys.executable) and command[1:3] == ["-m", DEMO_MODULE]:
        return True
    return command[0] in allowed_programs


class _Session:
    """One MCP client session, owned by a task on a private event loop in a daemon thread."""

    def __init__(self, config: dict[str, Any], outbound: OutboundPolicy = PUBLIC_ONLY) -> None:
        self.config = config
        self.outbound = outbound
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="mcp-client")
        self.thread.start()
        self.session: Any = None
        self.stop: asyncio.Event | None = None
        ready: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self.main = asyncio.run_coroutine_threadsafe(self._main(ready), self.loop)
        timeout = float(config.get("connect_timeout_s", 30.0))
        try:
            self.tools: list[Any] = ready.result(timeout)
        except concurrent.futures.TimeoutError:
            self.close()
            raise RuntimeError(f"the MCP server did not answer within {timeout:g} s") from None
        except BaseException as exc:
            self.close()
            raise RuntimeError(f"cannot connect to the MCP server: {_describe(exc)}") from exc

    async def _main(self, ready: concurrent.futures.Future[list[Any]]) -> None:
        from mcp import ClientSession

        self.stop = asyncio.Event()
        try:
            async with AsyncExitStack() as stack:
                streams = await stack.enter_async_context(await self._transport(stack))
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                tools: list[Any] = []
                cursor = None
                while True:
                    page = await session.list_tools(cursor=cursor) if cursor else await session.list_tools()
                    tools += page.tools
                    cursor = page.nextCursor
                    if not cursor:
                        break
                self.session = session
                ready.set_result(tools)
                await self.stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            elif not isinstance(exc, asyncio.CancelledError):
                raise

    async def _transport(self, stack: AsyncExitStack) -> Any:
        if "command" in self.config:
            from mcp import StdioServerParameters
            from mcp.client.stdio import get_default_environment, stdio_client

            command = list(self.config["command"])
            if command[0] in ("python", "python3"):
                command[0] = sys.executable
            # Not configuration: the child inherits this process's import path, as
            # get_default_environment() hands on PATH and HOME.
            pythonpath = os.pathsep.join(p for p in [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")] if p)
            env = {**get_default_environment(), "PYTHONPATH": pythonpath, **self.config.get("env", {})}
            parameters = StdioServerParameters(
                command=command[0], args=command[1:], env=env, cwd=str(REPO_ROOT)
            )
            return stdio_client(parameters)
        import httpx
        from mcp.client.streamable_http import streamable_http_client

        # The transport's own default client, with the team's headers, connecting only where the
        # outbound policy allows and following no redirect (it leaves a client it is given open:
        # the exit stack closes it after the session).
        client = await stack.enter_async_context(
            httpx.AsyncClient(
                transport=self.outbound.httpx_transport(),
                headers=self.config.get("headers") or None,
                timeout=httpx.Timeout(30, read=300),
                follow_redirects=False,
            )
        )
        return streamable_http_client(self.config["url"], http_client=client)

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        if self.session is None:
            raise RuntimeError("the MCP session is closed")
        # The tool runner (training.tools) reports the timeout at timeout_s; the session's own limits
        # are a second past it, so they never race it (under load they used to answer first with
        # the library's "Timed out while waiting for response" instead of the tool timeout).
        future = asyncio.run_coroutine_threadsafe(
            self.session.call_tool(name, arguments, read_timeout_seconds=timedelta(seconds=timeout_s + 1.0)),
            self.loop,
        )
        try:
            result = future.result(timeout_s + 2.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the MCP server did not answer within {timeout_s:g} s") from None
        except Exception as exc:
            raise MCPToolError(_describe(exc)) from None
        text = "\n".join(part.text for part in result.content if getattr(part, "type", "") == "text")
        if result.isError:
            raise MCPToolError(text or "the tool failed")
        if result.structuredContent is not None and not text:
            return result.structuredContent
        return text

    def close(self) -> None:
        if self.loop.is_closed():
            return
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        try:
            self.main.result(timeout=10)
        except BaseException:  # an unreachable server's task failed already; closing goes on
            self.main.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


def _describe(exc: BaseException) -> str:
    """One readable line, also for anyio's exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
