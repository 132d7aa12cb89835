"""Where a model server may listen: the one rule for the inference server, its checkpoint fetcher,
vLLM's launcher and the trainer service.

Invariant: a server that requires no token listens on loopback only, and none listens on a public
address. Entry points call `check_bind` before loading anything (a clear message, exit status 2);
`training.serving.server.serve` and `start_fetch_server` check the socket again.
"""

from __future__ import annotations

import argparse
import ipaddress


class InsecureBindError(ValueError):
    """A server would answer everyone: no token, on an address other hosts can reach."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``); "" and wildcards are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, token: str, dev_no_token: bool = False, token_variable: str, what: str) -> None:
    """Refuse, with a message that says what to do, to serve ``what`` on ``host``:

    - without a token, unless ``dev_no_token`` (a developer's explicit choice) and ``host`` is loopback;
    - on a public (global) address literal, token or not: bind loopback or a private network
      address, and publish through a reverse proxy or the web's gateway.
    A wildcard (0.0.0.0) stays allowed with a token: inside a container it is the private network's."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None
    if address is not None and address.is_global:
        raise InsecureBindError(
            f"{what}: refusing to listen on the public address {host}; bind 127.0.0.1 or a private "
            "network address (the gateway and the workers dial it there)"
        )
    if token:
        return
    if not dev_no_token:
        raise InsecureBindError(
            f"{what}: {token_variable} is not set, so every caller would be accepted; set it in the "
            "environment (never on the command line), or pass --dev-no-token with --host 127.0.0.1 "
            "for development on this machine only"
        )
    if not is_loopback(host):
        raise InsecureBindError(
            f"{what}: --dev-no-token is allowed only on a loopback host (127.0.0.1, ::1), not {host!r}; "
            f"set {token_variable} to serve on another address"
        )


def add_dev_no_token_argument(parser: argparse.ArgumentParser, *, token_variable: str) -> None:
    """A command line's ``--dev-no-token`` (see ``check_bind_or_exit``)."""
    parser.add_argument(
        "--dev-no-token", action="store_true",
        help=f"development only: serve without {token_variable} (refused unless --host is loopback)",
    )  # fmt: skip


def check_bind_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace, *, token: str,
                       token_variable: str, what: str) -> None:  # fmt: skip
    """``check_bind`` for a command line's ``args.host`` and ``--dev-no-token``: a refusal exits with
    status 2 and the message, before anything is loaded."""
    try:
        check_bind(args.host, token=token, dev_no_token=args.dev_no_token, token_variable=token_variable,
                   what=what)  # fmt: skip
    except InsecureBindError as exc:
        parser.exit(2, f"error: {exc}\n")
