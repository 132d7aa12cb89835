"""The API's body parsers (the settings' DEFAULT_PARSER_CLASSES).

JSON reads through ``training.rollouts.strict_json``: a body nested too deep, with NaN, an out-of-range
number, a lone surrogate or a NUL is a 400 naming the position, instead of a crash or a row
PostgreSQL refuses. JSON and form bodies are read into memory only up to
``DATA_UPLOAD_MAX_MEMORY_SIZE`` (DRF reads the raw stream, past Django's own check of that limit):
a larger body raises RequestDataTooBig, a 413 (projects.middleware). Multipart files are not
limited here (DRF hands them to Django's upload handlers).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from rest_framework.exceptions import ParseError
from rest_framework.parsers import FormParser, JSONParser, get_encoding  # type: ignore[attr-defined]

from training.rollouts import strict_json


def read_limited(stream: Any) -> bytes:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    raw = stream.read(limit + 1) if limit is not None else stream.read()
    if limit is not None and len(raw) > limit:
        raise RequestDataTooBig("Request body exceeded settings.DATA_UPLOAD_MAX_MEMORY_SIZE.")
    return raw


class StrictJSONParser(JSONParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        encoding = get_encoding(parser_context or {})
        raw = read_limited(stream)
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError as exc:
            raise ParseError(
                f"The body is not valid {encoding} text (byte {exc.start}).", code="invalid_json"
            ) from None
        try:
            return strict_json.loads(text, allow_nul=False)
        except strict_json.JSONError as exc:
            raise ParseError(f"The body is not valid JSON: {exc}", code="invalid_json") from None


class LimitedFormParser(FormParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        from io import BytesIO

        return super().parse(BytesIO(read_limited(stream)), media_type, parser_context)
