"""An MCP stdio server gets nothing from a team's config but allow-listed, checked values, and runs
inside the python grader's OS boundary (training/environments/stdio_child.py).

The attack these tests replay (issue 22): `config.env = {"PYTHONWARNINGS": "ignore::antigravity.x",
"BROWSER": "/bin/sh -c 'id > /tmp/pwned' #%s"}` on the shipped demo command made the child import
`antigravity`, which opened a "browser" through the shell: code execution as the web's user.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from training.config import ConfigError
from training.environments import build_environment, validate_environment
from training.environments.mcp import DEMO_MODULE, REPO_ROOT, MCPEnvironment, StdioPolicy

DEMO = ["python", "-m", DEMO_MODULE]
EVERYTHING = StdioPolicy(env_names=("*",))  # an operator who allows any name: steering names still fail


def namespaces_available() -> bool:
    from training.rewards.sandbox import SandboxConfig, SandboxUnavailable, sandbox_mode

    try:
        return sandbox_mode(SandboxConfig()) == "namespaces"
    except SandboxUnavailable:
        return False


@pytest.mark.parametrize(
    "name",
    [
        "PYTHONWARNINGS",
        "BROWSER",
        "PYTHONSTARTUP",
        "PYTHONPATH",
        "PYTHONINSPECT",
        "PYTHONHOME",
        "pythonpath",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "PATH",
        "HOME",
        "BASH_ENV",
        "NODE_OPTIONS",
        "PERL5OPT",
        "GCONV_PATH",
        "HTTPS_PROXY",
    ],
)
def test_a_variable_that_steers_an_interpreter_is_refused_naming_the_key(name):
    with pytest.raises(ConfigError) as caught:
        validate_environment(
            "mcp", config={"command": DEMO, "env": {name: "x"}}, tools=[], max_turns=None, stdio=EVERYTHING
        )
    assert caught.value.field == f"config.env.{name}"
    assert "never passed" in caught.value.message


def test_only_names_the_operator_allows_may_be_set_with_plain_values():
    policy = StdioPolicy(env_names=("GITHUB_*", "REGION"))
    ok = validate_environment(
        "mcp",
        config={"command": DEMO, "env": {"GITHUB_TOKEN": "t", "REGION": "eu"}},
        tools=[],
        max_turns=None,
        stdio=policy,
    )
    assert ok["config"]["env"] == {"GITHUB_TOKEN": "t", "REGION": "eu"}
    refused = [
        ({"TOKEN": "t"}, "config.env.TOKEN", "operator allows"),
        ({"REGION": "eu\nPYTHONSTARTUP=/x"}, "config.env.REGION", "one line"),
        ({"REGION": "x" * 5000}, "config.env.REGION", "one line"),
        ({"REGION": "a\0b"}, "config.env.REGION", "one line"),
        ({"BAD NAME": "x"}, "config.env", "not a variable name"),
    ]
    for env, field, words in refused:
        with pytest.raises(ConfigError) as caught:
            validate_environment(
                "mcp", config={"command": DEMO, "env": env}, tools=[], max_turns=None, stdio=policy
            )
        assert (caught.value.field, words in caught.value.message) == (field, True), env
    with pytest.raises(ConfigError) as caught:  # no operator list: no variable at all
        validate_environment(
            "mcp", config={"command": DEMO, "env": {"REGION": "eu"}}, tools=[], max_turns=None
        )
    assert caught.value.field == "config.env.REGION"


@pytest.mark.parametrize(
    "command",
    [
        [*DEMO, "--http", "--port", "8765"],  # the demo server's own flags: a listener on the host
        ["python", "-c", "import os; os.system('id')"],
        ["python", "-m", "http.server"],
        ["python", "-I", "-m", DEMO_MODULE],
        ["python", "-m", DEMO_MODULE, "-c", "print(1)"],
        ["python", DEMO_MODULE],
        ["/bin/sh", "-c", "id"],
    ],
)
def test_anything_but_the_exact_demo_command_is_refused(command):
    with pytest.raises(ConfigError) as caught:
        validate_environment("mcp", config={"command": command}, tools=[], max_turns=None, stdio=EVERYTHING)
    assert caught.value.field == "config.command"


def test_an_operator_command_is_matched_whole_arguments_included():
    policy = StdioPolicy(commands=("/opt/mcp/warehouse --stdio --db '/srv/stock db'",))
    exact = ["/opt/mcp/warehouse", "--stdio", "--db", "/srv/stock db"]
    assert validate_environment("mcp", config={"command": exact}, tools=[], max_turns=None, stdio=policy)
    for other in (
        exact[:1],
        exact[:2],
        [*exact, "--plugin", "/tmp/evil.so"],
        ["/opt/mcp/warehouse2", *exact[1:]],
    ):
        with pytest.raises(ConfigError):
            validate_environment("mcp", config={"command": other}, tools=[], max_turns=None, stdio=policy)


def _unvalidated(config: dict, stdio: StdioPolicy) -> MCPEnvironment:
    """An environment built from a config that never passed validation (a row stored before it)."""
    return MCPEnvironment(
        system_prompt="", max_turns=2, tool_timeout_s=10.0, tool_names=[], stdio=stdio, config=config
    )


ATTACKS = {
    "PYTHONWARNINGS": "ignore::antigravity.x",
    "BROWSER": "/bin/sh -c 'echo PWNED-BROWSER >&2; touch {marker}' #%s",
    "PYTHONSTARTUP": "{startup}",
    "PYTHONINSPECT": "1",
    "PYTHONPATH": "{pythonpath}",
    "LD_PRELOAD": "/nonexistent/evil.so",
}


@pytest.mark.parametrize("sandboxed", [True, False], ids=["namespaces", "unsandboxed"])
def test_the_attack_payloads_run_nothing_even_past_validation(tmp_path, capfd, sandboxed):
    if sandboxed and not namespaces_available():
        pytest.fail("this machine cannot create namespaces; the sandboxed variant cannot be checked")
    marker = tmp_path / "pwned"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        f"import sys; sys.stderr.write('PWNED-SITECUSTOMIZE\\n'); open({str(marker)!r}, 'w').close()\n"
    )
    (tmp_path / "startup.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {
        name: value.format(marker=marker, startup=tmp_path / "startup.py", pythonpath=tmp_path / "site")
        for name, value in ATTACKS.items()
    }
    # Unsandboxed (the development opt-out) shares the host's files: -I and the fixed environment
    # are then what stops the payloads, so the marker on the host would show a failure.
    policy = (
        StdioPolicy() if sandboxed else StdioPolicy(unshare="/nonexistent/unshare", allow_unsandboxed=True)
    )
    environment = _unvalidated({"command": DEMO, "env": env}, policy)
    with environment:
        assert [tool.name for tool in environment.tools] == [
            "search_products",
            "get_product",
            "list_categories",
        ]
        assert "P-101" in environment.tools[1].function(product_id="P-101")
    captured = capfd.readouterr()
    assert "PWNED" not in captured.err + captured.out
    assert not marker.exists()


def test_an_unlisted_command_past_validation_starts_nothing(tmp_path):
    marker = tmp_path / "ran"
    environment = _unvalidated({"command": ["/bin/sh", "-c", f"touch {marker}"]}, StdioPolicy())
    with pytest.raises(RuntimeError, match="not allowed"):
        environment.open()
    assert not marker.exists()


PROBE_SERVER = textwrap.dedent(
    """
    import json, os, socket, sys
    from mcp.server.fastmcp import FastMCP

    server = FastMCP("probe", log_level="WARNING")

    def readable(path):
        try:
            with open(path, "rb") as handle:
                return handle.read(64).decode("utf-8", "replace")
        except OSError as error:
            return type(error).__name__

    @server.tool()
    def probe(secret: str, port: int, repo: str) -> str:
        \"\"\"What the server can see and do.\"\"\"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                network = "connected"
        except OSError as error:
            network = type(error).__name__
        return json.dumps({
            "uid": os.getuid(),
            "secret": readable(secret),
            "host_environ": readable("/proc/1/environ"),
            "root": sorted(os.listdir("/")),
            "repo": sorted(os.listdir(repo)),
            "environ": sorted(os.environ),
            "cwd": os.getcwd(),
            "network": network,
            "pids": sorted(p for p in os.listdir("/proc") if p.isdigit()),
        })

    server.run("stdio")
    """
)


def test_the_server_runs_as_nobody_without_network_or_the_hosts_files(tmp_path):
    if not namespaces_available():
        pytest.fail("this machine cannot create namespaces; the sandbox cannot be checked")
    server = tmp_path / "probe_server.py"
    server.write_text(PROBE_SERVER)
    secret = tmp_path / "secret_key"
    secret.write_text("do-not-read")
    secret.chmod(0o644)  # world-readable on the host: only the mount boundary hides it
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    policy = StdioPolicy(commands=(f"{sys.executable} {server}",), env_names=("REGION",))
    with (
        listener,
        build_environment(
            "mcp", config={"command": [sys.executable, str(server)], "env": {"REGION": "eu"}}, stdio=policy
        ) as environment,
    ):
        seen = json.loads(environment.tools[0].function(secret=str(secret), port=port, repo=str(REPO_ROOT)))
    assert seen["network"] in ("OSError", "ConnectionRefusedError") and seen["network"] != "connected"
    assert seen["secret"] == "FileNotFoundError"
    assert seen["environ"] == ["HOME", "LANG", "PATH", "REGION"]
    assert seen["cwd"] == "/tmp"
    assert "var" not in seen["root"] and "root" in seen["root"]
    assert set(seen["repo"]) <= {"training", Path(sys.prefix).name}  # not data/, with the secret key
    if os.geteuid() == 0:
        assert seen["uid"] == 65534
    assert seen["pids"] == ["1"]  # its own PID namespace: the launcher, nothing of the host's
    # /proc/1 is the server itself (its own PID namespace): its environment holds nothing of the host's.
    assert seen["host_environ"].startswith("HOME=/tmp\0") and "DATABASE" not in seen["host_environ"]


def test_a_sandboxed_server_leaves_no_directory_behind(tmp_path, monkeypatch):
    if not namespaces_available():
        pytest.fail("this machine cannot create namespaces; the sandbox cannot be checked")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with build_environment("mcp", config={"command": DEMO}) as environment:
        assert environment.tools
        assert any(path.name.startswith("artweb-mcp-") for path in tmp_path.iterdir())
    assert not any(path.name.startswith("artweb-mcp-") for path in tmp_path.iterdir())
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_demo_server_files_it_needs_are_all_it_sees_of_the_repository():
    from training.environments.mcp import _visible_paths

    read_only, _links = _visible_paths([])
    inside = [path for path in read_only if path.startswith(str(REPO_ROOT))]
    assert str(REPO_ROOT) not in read_only  # not the checkout (its data/ holds the secret key)
    assert str(REPO_ROOT / "training") in inside
    assert all(
        Path(path).is_relative_to(REPO_ROOT / "training") or Path(path).is_relative_to(sys.prefix)
        for path in inside
    ), inside


@pytest.mark.parametrize(
    "headers, field",
    [
        ({"Authorization": "Bearer t\r\nX-Evil: 1"}, "config.headers.Authorization"),
        ({"X-Token": "a\nb"}, "config.headers.X-Token"),
        ({"Bad Name": "x"}, "config.headers"),
        ({"X-Long": "x" * 9000}, "config.headers.X-Long"),
    ],
)
def test_a_header_that_could_split_a_request_is_refused_when_written(headers, field):
    with pytest.raises(ConfigError) as caught:
        validate_environment(
            "mcp", config={"url": "https://mcp.example.com/mcp", "headers": headers}, tools=[], max_turns=None
        )
    assert caught.value.field == field
