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

Safety invariant: nothing a team writes reaches a child process except through an allow-list.
A stdio command is either exactly the shipped demo server (`python -m
training.environments.mcp_demo.server`, no further arguments) or exactly one of the operator's
commands (`StdioPolicy.commands`); `config.env` may only set names the operator allows
(`StdioPolicy.env_names`), never one that steers an interpreter, the loader or a shell
(`PYTHON*`, `LD_*`, `BROWSER`, `PATH`, ...), with short single-line values. The child's argv,
working directory and the rest of its environment come from code. It runs in the python grader's OS
boundary (`stdio_child.py`): fresh namespaces (no network unless the operator allows it for its
own commands), a root made of read-only binds of the interpreter, its packages and `training/`
only, uid nobody, resource limits; and it holds a sandbox slot (``training.safety.slots``) for its life.
A URL is reached through the `outbound` policy (``training.safety.outbound``: public addresses only
unless the operator allow-lists the host; the connection goes to the checked address; redirects are
not followed).

Why one module of this length: the concurrency invariant below spans the whole client (one event-
loop thread owning the transports, the stdio sandbox, HTTP through the outbound policy, shutdown);
split, no part could be read without the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fnmatch
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
from collections.abc import Set
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
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
from training.rollouts.tools import Tool
from training.safety.outbound import PUBLIC_ONLY, OutboundPolicy, OutboundRefused, ascii_url
from training.safety.slots import SlotHolder, SlotPolicy
from training.wire.headers import MAX_HEADER_VALUE_CHARS, header_problem

DEMO_MODULE = "training.environments.mcp_demo.server"
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_HELP = {
    "command": f'stdio server: the command as a list, e.g. ["python", "-m", "{DEMO_MODULE}"]',
    "url": "streamable HTTP server: its URL, e.g. https://mcp.example.com/mcp (a public address, or a host the operator allows)",
    "env": "stdio server: environment variables the operator allows (MCP_STDIO_ENV), as an object of strings",
    "headers": "HTTP server: extra request headers (object of strings)",
    "connect_timeout_s": "seconds to connect and list the tools (default 30)",
}


# Names that steer an interpreter, the dynamic loader, a shell or where things are looked up:
# refused in `config.env` even when the operator's allow-list would match them.
STEERING_NAMES = frozenset(
    [
        "PATH",
        "HOME",
        "SHELL",
        "ENV",
        "BASH_ENV",
        "BROWSER",
        "IFS",
        "CDPATH",
        "PS4",
        "PROMPT_COMMAND",
        "TMPDIR",
        "TMP",
        "TEMP",
        "EDITOR",
        "VISUAL",
        "PAGER",
        "CLASSPATH",
        "GCONV_PATH",
        "LOCPATH",
        "NLSPATH",
        "HOSTALIASES",
        "RESOLV_HOST_CONF",
        "LOCALDOMAIN",
        "RES_OPTIONS",
        "GLIBC_TUNABLES",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "TERMINFO",
        "TZDIR",
        "USER",
        "LOGNAME",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
        "FTP_PROXY",
        "LANG",
        "LANGUAGE",
    ]
)
STEERING_PREFIXES = (
    "PYTHON",
    "LD_",
    "DYLD_",
    "NODE_",
    "NPM_",
    "PERL",
    "RUBY",
    "GEM_",
    "BUNDLE_",
    "JAVA",
    "_JAVA",
    "JDK_",
    "LUA_",
    "MALLOC_",
    "LC_",
    "GIT_",
    "XDG_",
    "UV_",
    "PIP_",
    "CONDA",
    "VIRTUAL_ENV",
    "TCL",
    "OPENSSL_",
    "DOTNET_",
    "GOFLAGS",
    "R_",
    "BASH_FUNC_",
)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_ENV_VARIABLES = 32
MAX_ENV_VALUE_CHARS = 4096
FIXED_ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
# What a stdio server sees of the host besides the interpreter and `training/` (read-only).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_PATHS = (
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/resolv.conf",
    "/etc/localtime",
    "/etc/ld.so.cache",
    "/etc/ssl/certs",
    "/etc/ca-certificates",
    "/etc/alternatives",
)
UNPRIVILEGED_UID = 65534  # nobody, as for the python grader
CHILD_PROGRAM = (Path(__file__).parent / "stdio_child.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class StdioPolicy:
    """The operator's rules and limits for MCP stdio servers (settings, from the environment); a
    team's config never changes them."""

    commands: tuple[str, ...] = ()  # exact commands (shell words) allowed besides the demo server
    env_names: tuple[str, ...] = ()  # names, or patterns like GITHUB_*, a config.env may set
    network: bool = False  # the operator's own commands keep the host's network
    memory_bytes: int = 1024 * 1024 * 1024  # RLIMIT_AS
    cpu_seconds: int = 3600  # RLIMIT_CPU over the server's life
    open_files: int = 256  # RLIMIT_NOFILE
    processes: int = 1024  # RLIMIT_NPROC for uid nobody (threads included), all sandboxes together
    file_size_bytes: int = 8 * 1024 * 1024  # RLIMIT_FSIZE
    disk_bytes: int = 16 * 1024 * 1024  # its private /tmp
    unshare: str = "unshare"
    allow_unsandboxed: bool = False  # development only, as GRADER_SANDBOX_ALLOW_UNSANDBOXED
    slots: SlotPolicy = field(default_factory=SlotPolicy)
    team: str = ""  # whose slot a server takes


def is_demo_command(command: list[str]) -> bool:
    return command[0] in ("python", "python3", sys.executable) and command[1:] == ["-m", DEMO_MODULE]


def operator_command(command: list[str], policy: StdioPolicy) -> bool:
    return any(shlex.split(allowed) == command for allowed in policy.commands)


def check_environment_variables(env: Any, policy: StdioPolicy) -> None:
    """ConfigError naming the key unless every variable is allowed and its value plain."""
    if not isinstance(env, dict):
        raise ConfigError("config.env", "must be an object of strings")
    if len(env) > MAX_ENV_VARIABLES:
        raise ConfigError("config.env", f"at most {MAX_ENV_VARIABLES} variables")
    for name, value in env.items():
        where = f"config.env.{name}"
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise ConfigError("config.env", f"{name!r} is not a variable name (letters, digits, _)")
        upper = name.upper()
        if upper in STEERING_NAMES or upper.startswith(STEERING_PREFIXES):
            raise ConfigError(
                where, "steers the interpreter, the loader or a shell and is never passed to a server"
            )
        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in policy.env_names):
            allowed = ", ".join(policy.env_names) or "none"
            raise ConfigError(
                where, f"not a variable the operator allows (MCP_STDIO_ENV; allowed: {allowed})"
            )
        if not isinstance(value, str):
            raise ConfigError(where, "must be a string")
        if len(value) > MAX_ENV_VALUE_CHARS or any(c in value for c in "\0\n\r"):
            raise ConfigError(where, f"must be one line of at most {MAX_ENV_VALUE_CHARS} characters")


def check_headers(
    headers: Any,
    where: str,
    *,
    reserved: Set[str] = frozenset(),
    reserved_message: str = "is set by the HTTP client",
) -> None:
    """ConfigError naming ``where`` (or ``where.<name>``) unless ``headers`` is an object of strings
    that ``training.wire.headers`` lets through (the endpoint grader's rule too); ``reserved``: the
    caller's own lower-case names besides the framing ones, refused with ``reserved_message`` (the
    http_tools kind's per-tool headers)."""
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise ConfigError(where, "must be an object of strings")
    for name, value in headers.items():
        problem = header_problem(name, value, reserved=reserved)
        if problem == "reserved":
            raise ConfigError(f"{where}.{name}", reserved_message)
        if problem == "name":
            raise ConfigError(where, f"{name!r} is not a header name")
        if problem == "value":
            raise ConfigError(
                f"{where}.{name}", f"must be one line of at most {MAX_HEADER_VALUE_CHARS} characters"
            )


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
        self.stdio: StdioPolicy = settings.pop("stdio", None) or StdioPolicy()
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
        cls, config: Any, tools: Any, max_turns: int | None, *, stdio: StdioPolicy | None = None
    ) -> dict[str, Any]:
        stdio = stdio or StdioPolicy()
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
            if not (is_demo_command(command) or operator_command(command, stdio)):
                raise ConfigError(
                    "config.command",
                    f"only the demo server (exactly python -m {DEMO_MODULE}) and the commands the "
                    "operator allows (MCP_STDIO_PROGRAMS, matched whole, arguments included) may run",
                )
        else:
            url = config["url"]
            try:  # kept as it is called: a non-ASCII host as its IDNA name (http.client sends no other)
                url = config["url"] = ascii_url(url) if isinstance(url, str) else url
            except OutboundRefused as exc:
                raise ConfigError("config.url", str(exc)) from None
            parsed = urlparse(url) if isinstance(url, str) else None
            if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ConfigError("config.url", "must be an http:// or https:// URL")
        check_headers(config.get("headers", {}), "config.headers")
        if "env" in config and "command" not in config:
            raise ConfigError("config.env", "only for a stdio server (config.command)")
        if "headers" in config and "url" not in config:
            raise ConfigError("config.headers", "only for an HTTP server (config.url)")
        if "env" in config:
            check_environment_variables(config["env"], stdio)
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
            session = _Session(self.config, self.outbound, self.stdio)
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


class _Session:
    """One MCP client session, owned by a task on a private event loop in a daemon thread."""

    def __init__(
        self, config: dict[str, Any], outbound: OutboundPolicy = PUBLIC_ONLY, stdio: StdioPolicy | None = None
    ) -> None:
        self.config = config
        self.outbound = outbound
        self.stdio = stdio or StdioPolicy()
        self.slot = SlotHolder()
        self.root: str | None = None  # the empty directory a stdio server's new root is mounted on
        if "command" in config:
            self.slot.acquire(self.stdio.slots, self.stdio.team)  # SlotsBusy propagates: nothing started
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
            from mcp.client.stdio import stdio_client

            command, environment = self._sandboxed_command()
            parameters = StdioServerParameters(
                command=command[0], args=command[1:], env=environment, cwd=self.root or "/"
            )
            return stdio_client(parameters, errlog=sys.stderr)  # now: the default is bound at import
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

    def _sandboxed_command(self) -> tuple[list[str], dict[str, str]]:
        """The launcher's command line and environment: every part from code and the operator's
        policy; a team's config contributes only its allowed, checked `env` values."""
        from training.rewards.sandbox import SandboxConfig, SandboxUnavailable, sandbox_mode

        policy = self.stdio
        command = list(self.config["command"])
        demo = is_demo_command(command)
        if not demo and not operator_command(command, policy):  # a config that skipped validation
            raise RuntimeError("this stdio command is not allowed")
        try:
            mode = sandbox_mode(
                SandboxConfig(unshare=policy.unshare, allow_unsandboxed=policy.allow_unsandboxed)
            )
        except SandboxUnavailable as error:
            raise RuntimeError(str(error).replace("python grader", "MCP stdio server")) from None
        isolate = mode == "namespaces"
        as_root = os.geteuid() == 0
        self.root = tempfile.mkdtemp(prefix="artweb-mcp-")
        program = "" if demo else (shutil.which(command[0], path=FIXED_ENVIRONMENT["PATH"]) or command[0])
        read_only, links = _visible_paths([] if demo else [program, *command[1:]])
        user_environment = dict(self.config.get("env") or {})
        environment = {**FIXED_ENVIRONMENT, **user_environment}
        child = {
            "isolate": isolate,
            "root": self.root,
            "directory": self.root,
            "read_only": read_only,
            "links": links,
            "uid": UNPRIVILEGED_UID if as_root and isolate else None,
            "limits": {
                "memory_bytes": policy.memory_bytes,
                "cpu_seconds": policy.cpu_seconds,
                "open_files": policy.open_files,
                "processes": policy.processes,
                "file_size_bytes": policy.file_size_bytes,
                "disk_bytes": policy.disk_bytes,
            },
            "environment": sorted(environment),
            "module": DEMO_MODULE if demo else "",
            "sys_path": [
                str(REPO_ROOT),
                *(p for p in sys.path if p and os.path.exists(p) and p != str(REPO_ROOT)),
            ],
            "program": program,
            "argv": command,
        }
        launcher = [sys.executable, "-I", "-S", "-B", "-c", CHILD_PROGRAM, json.dumps(child)]
        if isolate:
            flags = ["--pid", "--fork", "--kill-child", "--mount", "--ipc", "--uts"]
            if demo or not policy.network:
                flags.append("--net")
            if not as_root:
                flags.insert(0, "--map-root-user")
            launcher = [shutil.which(policy.unshare) or policy.unshare, *flags, "--", *launcher]
        return launcher, environment

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        if self.session is None:
            raise RuntimeError("the MCP session is closed")
        # The tool runner (training.rollouts.tools) reports the timeout at timeout_s; the session's own limits
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
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)  # empty on the host: the tmpfs was the child's
            self.root = None
        self.slot.release()


def _describe(exc: BaseException) -> str:
    """One readable line, also for anyio's exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def _visible_paths(named: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """What a stdio server's root holds, read-only: system libraries, a few /etc files, this
    interpreter with its packages, `training/`, and the files an operator's command names. Top
    level symlinks (a merged /usr's /bin -> usr/bin) are recreated, not bound."""
    read_only: list[str] = []
    links: list[tuple[str, str]] = []
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            read_only.append(path)
    candidates = [*ETC_PATHS, sys.base_prefix, sys.prefix, os.path.realpath(sys.base_prefix)]
    candidates += [p for p in sys.path if p and os.path.isdir(p) and p != str(REPO_ROOT)]
    candidates.append(str(REPO_ROOT / "training"))
    for path in named:
        if os.path.isabs(path) and os.path.exists(path):
            real = os.path.realpath(path)
            candidates.append(os.path.dirname(real) if os.path.isfile(real) and path == named[0] else real)
    for path in candidates:
        path = os.path.normpath(path)
        if not os.path.exists(path) or os.path.islink(path):
            continue
        covered = any(path == kept or path.startswith(kept.rstrip("/") + "/") for kept in read_only)
        if not covered:
            read_only = [kept for kept in read_only if not kept.startswith(path.rstrip("/") + "/")]
            read_only.append(path)
    return sorted(read_only, key=len), links
