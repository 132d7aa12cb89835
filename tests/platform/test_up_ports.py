"""``manage.py up`` binds its ports before it starts anything and hands each listening socket to the
server that serves on it (no window between a check and a bind in which another process could take
one): a busy web port is refused naming it and the fix, a busy inference or trainer port is swapped
for a free one on one line; "artweb is up" is printed only once the web server answers."""

from __future__ import annotations

import io
import os
import signal
import socket
import urllib.request

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from artweb.management.commands import up
from artweb.management.commands.up import listen_or_another, wait_for_web
from artweb.stack import Stack, listen, web_command


def listening() -> tuple[socket.socket, int]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server, server.getsockname()[1]


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines.append(text)


def test_a_port_up_listens_on_cannot_be_taken_until_it_is_closed():
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    # Bound and listening: another bind fails even with SO_REUSEADDR (a bound-only socket would not
    # stop a second one on Linux: the clash came at the server's listen, after `up` said it was up).
    with pytest.raises(OSError):
        listen("127.0.0.1", port)
    sock.close()
    listen("127.0.0.1", port).close()


def test_a_busy_port_is_swapped_for_a_free_one_on_one_line():
    server, port = listening()
    stdout = Lines()
    try:
        sock = listen_or_another("127.0.0.1", port, what="the trainer service's", stdout=stdout)
    finally:
        server.close()
    other = sock.getsockname()[1]
    sock.close()
    assert other != port
    assert stdout.lines == [f"Port {port} (the trainer service's) is in use: it takes {other} instead."]


@pytest.mark.django_db
def test_up_refuses_a_busy_web_port_before_starting_anything(capsys):
    server, port = listening()
    try:
        with pytest.raises(
            CommandError, match=f"port {port} on 127.0.0.1 is in use: choose another with `make up PORT="
        ):
            call_command("up", "--port", str(port), "--demo-steps", "0", "--no-inference")
    finally:
        server.close()


class DeadStack:
    """A stack whose web server exits before it answers: nothing is started."""

    def __init__(self, log_dir) -> None:
        self.log_dir = log_dir
        self.started: dict[str, list[str]] = {}

    def start(self, name, command, *, sock=None):
        self.started[name] = command
        if sock is not None:
            sock.close()

    def check_alive(self):
        raise RuntimeError("web exited with code 1")

    def stop(self):
        pass


@pytest.fixture
def restored_process_state():
    """``up`` sets signal handlers and its children's environment in this process: put them back."""
    environ, handlers = (
        dict(os.environ),
        {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)},
    )
    yield
    os.environ.clear()
    os.environ.update(environ)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.mark.django_db
def test_up_says_it_is_up_only_once_the_web_server_answers(monkeypatch, restored_process_state):
    monkeypatch.setattr(up, "Stack", DeadStack)
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="web exited"):
        call_command(
            "up", "--port", "0", "--demo-steps", "0", "--no-inference", "--trainer-port", "0", stdout=out,
        )  # fmt: skip
    assert "artweb is up" not in out.getvalue() and "Stopped." in out.getvalue()


def test_wait_for_web_waits_for_an_answer_not_for_a_listening_socket():
    sock = listen("127.0.0.1", 0)  # connections queue in the backlog, but nothing answers them
    try:
        with pytest.raises(CommandError, match="did not answer"):
            wait_for_web(
                f"http://127.0.0.1:{sock.getsockname()[1]}/healthz", stack=AliveStack(), timeout_s=1.0
            )
    finally:
        sock.close()


class AliveStack:
    def check_alive(self):
        pass


def test_the_web_server_serves_on_the_socket_up_bound(tmp_path, monkeypatch):
    (tmp_path / "prometheus").mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prometheus"))
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    stack = Stack(tmp_path / "logs")
    try:
        stack.start("web", web_command(fd=sock.fileno()), sock=sock)
        with pytest.raises(OSError):  # held all the while the child starts
            listen("127.0.0.1", port)
        wait_for_web(f"http://127.0.0.1:{port}/healthz", stack=stack, timeout_s=120)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            assert response.read() == b'{"status": "ok"}'
    finally:
        stack.stop()
