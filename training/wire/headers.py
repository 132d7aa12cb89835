"""The headers a team sets on artweb's calls to its services: an MCP server's `config.headers`, an
http_tools tool's `headers` and an endpoint grader's `headers` (sent by
``training.wire.openai_http.post_json``, or by the MCP client's httpx). One rule for all three:

- a name is an HTTP token (RFC 9110) of 1 to 256 characters;
- a value is one line (no CR, LF or NUL: http.client refuses them only when it sends, and a line
  break would start a header of the team's choosing) of at most 8192 characters;
- a header that frames the request (FRAMING_HEADERS) is the HTTP client's, and one the caller sets
  on every call (an http_tools call's ids) is the caller's: a team's value would corrupt them.

``header_problem`` says which rule a header breaks; each caller words the refusal in its own error
(an environment's ConfigError, a grader's spec problem).
"""

from __future__ import annotations

import re
from collections.abc import Set
from typing import Any, Literal

HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}")  # an HTTP token (RFC 9110)
MAX_HEADER_VALUE_CHARS = 8192
# Lower-case names: the body's length and the connection, which the HTTP client writes itself.
FRAMING_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})

HeaderProblem = Literal["not_string", "reserved", "name", "value"]


def header_problem(name: Any, value: Any, *, reserved: Set[str] = frozenset()) -> HeaderProblem | None:
    """Which rule ``name: value`` breaks, the first in this order, or None when it may be sent:
    ``not_string`` (a name or value that is not a string), ``reserved`` (a framing header, or one of
    the caller's own ``reserved`` names, lower-case), ``name`` (not an HTTP token), ``value`` (not
    one line of at most MAX_HEADER_VALUE_CHARS characters)."""
    if not isinstance(name, str) or not isinstance(value, str):
        return "not_string"
    if name.lower() in FRAMING_HEADERS or name.lower() in reserved:
        return "reserved"
    if not HEADER_NAME.fullmatch(name):
        return "name"
    if len(value) > MAX_HEADER_VALUE_CHARS or any(c in value for c in "\0\r\n"):
        return "value"
    return None
