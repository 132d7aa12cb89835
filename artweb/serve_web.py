"""``python -m artweb.serve_web --fd N``: the web server (uvicorn, ``artweb.asgi:application``) on a
listening socket its parent bound (``artweb.stack.listen``) and handed down, so the port is held
from ``manage.py up``'s first line, with no window in which another process could take it.

uvicorn's own ``--fd`` takes the descriptor as a Unix socket (no TCP_NODELAY, client addresses
misread); this reads its family from the descriptor."""

from __future__ import annotations

import argparse
import socket


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="an inherited listening TCP socket")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)  # family, type and protocol read from the descriptor
    config = uvicorn.Config("artweb.asgi:application", log_level=args.log_level)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
