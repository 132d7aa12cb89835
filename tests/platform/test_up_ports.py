"""``manage.py up`` checks its ports before it starts anything: a busy web port is refused naming
it and the fix, a busy inference port is swapped for a free one (a second artweb on the host, or
any other server, on 8100)."""

from __future__ import annotations

import socket

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from artweb.management.commands.up import port_free


def listening() -> tuple[socket.socket, int]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server, server.getsockname()[1]


def test_a_port_a_server_listens_on_is_not_free_and_is_once_it_closes():
    server, port = listening()
    assert not port_free("127.0.0.1", port)
    server.close()
    assert port_free("127.0.0.1", port)


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
