"""The gateway's database threads: a small pool of our own, whose threads keep their database
connection between requests (Django's per-request threads under ASGI would open a new one for
every request), at most DB_THREADS per web process; a connection that failed is dropped and
reopened on its next use. See projects.gateway.views for why."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import connections

DB_THREADS = 4
_db_executor = ThreadPoolExecutor(max_workers=DB_THREADS, thread_name_prefix="gateway-db")

P = ParamSpec("P")
R = TypeVar("R")


def in_db_thread(func: Callable[P, R]) -> Callable[P, Any]:
    """``func`` as a coroutine function run on the gateway's database threads."""

    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        for connection in connections.all(initialized_only=True):
            if connection.errors_occurred and not connection.is_usable():
                connection.close()
        return func(*args, **kwargs)

    return sync_to_async(run, thread_sensitive=False, executor=_db_executor)


def close_db_thread_connections() -> None:
    """Close the connection each database thread holds (tests, before the test database goes)."""
    barrier = threading.Barrier(DB_THREADS, timeout=10)

    def close() -> None:
        barrier.wait()  # one call per thread: each waits until all threads hold one
        connections.close_all()

    for future in [_db_executor.submit(close) for _ in range(DB_THREADS)]:
        future.result()
