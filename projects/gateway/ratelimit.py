"""Requests per minute per API key: a fixed one-minute window counted in Django's cache.

Why the cache and a fixed window: one atomic ``incr`` per request, no table to grow or clean up
(counters expire with their window), and no database write on the gateway's hot path. The cost
of a fixed window is that a client can send up to twice the limit across a window boundary;
for protecting shared inference servers that is acceptable. The embedded default cache is
per-process memory, exact for the one web process ``make up`` starts; several web processes
must share a cache (``CACHE_URL=redis://…``) for the limit to hold across them.
"""

from __future__ import annotations

import time

from django.core.cache import cache

WINDOW_S = 60


def rate_limit_hit(*, api_key_id: int, limit_per_minute: int, now: float | None = None) -> int | None:
    """Count one request; None if it is allowed, else the seconds until the window resets
    (for ``Retry-After``). A limit of 0 means unlimited."""
    if limit_per_minute <= 0:
        return None
    now = time.time() if now is None else now
    window = int(now // WINDOW_S)
    key = f"ratelimit:{api_key_id}:{window}"
    cache.add(key, 0, timeout=WINDOW_S + 5)
    try:
        count = cache.incr(key)
    except ValueError:  # evicted between add and incr
        cache.set(key, 1, timeout=WINDOW_S + 5)
        count = 1
    if count <= limit_per_minute:
        return None
    return max(1, int((window + 1) * WINDOW_S - now + 0.999))
