"""The one decoder of compressed request bodies (``Content-Encoding``), bounded like the bodies.

Invariant: a decoded body never holds more than the route's limit plus one call's worth of
output, whatever the frame declares. zstd's one-shot ``decompress`` allocates the content size a
frame declares (a 32 KB frame declaring 1 GiB took 1 GiB), so bodies are decoded as a stream
(``decompressobj``), fed in slices small enough that even zstd's densest blocks (an RLE block: 4
bytes for 128 KiB) cannot overshoot the bytes still allowed by much, and stopped past the limit.

Accepted: ``identity`` everywhere; ``zstd`` where the route lists it (``/tinker/``: the SDK can
compress its bodies). Anything else is a 415, never parsed as if it were plain.
"""

from __future__ import annotations

from projects.errors import DomainError

ZSTD = "zstd"
IDENTITY = "identity"
# zstd's densest block: a 3-byte header and one byte repeated up to the 128 KiB block size.
_DENSEST_INPUT, _DENSEST_OUTPUT = 4, 128 * 1024
_MIN_SLICE, _MAX_SLICE = _DENSEST_INPUT, 64 * 1024
# Far above what zstd's levels 1-19 pick (8 MiB at most); a frame asking more is refused, so its
# window buffer is not allocated either.
MAX_WINDOW_BYTES = 8 * 1024 * 1024


class BodyTooLarge(DomainError):
    status_code = 413
    code = "body_too_large"


class UnsupportedEncoding(DomainError):
    status_code = 415
    code = "unsupported_media_type"


class UnreadableBody(DomainError):
    status_code = 400
    code = "invalid_encoding"


def encoding_of(header: str | None, *, accepted: tuple[str, ...]) -> str:
    """The one encoding ``header`` names (``identity`` when none), or a 415 naming what is accepted."""
    name = (header or "").strip().lower()
    if name in ("", IDENTITY):
        return IDENTITY
    if name not in accepted:
        offered = (
            f"'{IDENTITY}' or " + " or ".join(f"'{a}'" for a in accepted) if accepted else f"'{IDENTITY}'"
        )
        raise UnsupportedEncoding(
            f"Content-Encoding {header!r} is not accepted here: send the body uncompressed ({offered})",
            field="Content-Encoding",
        )
    return name


def decoded_body(data: bytes, header: str | None, *, limit: int, setting: str,
                 accepted: tuple[str, ...]) -> bytes:  # fmt: skip
    """``data`` decoded as ``header`` says: at most ``limit`` bytes, or a 413 naming ``setting``."""
    if encoding_of(header, accepted=accepted) == IDENTITY:
        return data
    return _zstd(data, limit=limit, setting=setting)


def _too_large(limit: int, setting: str) -> BodyTooLarge:
    return BodyTooLarge(
        f"The request body is larger than the limit of {limit} bytes ({setting}) once decompressed."
    )


def _zstd(data: bytes, *, limit: int, setting: str) -> bytes:
    import zstandard

    try:
        declared = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as exc:
        raise UnreadableBody(f"the body is not a zstd frame: {exc}") from None
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > limit:
        raise _too_large(limit, setting)  # said up front: nothing to decode
    stream = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).decompressobj()
    view = memoryview(data)
    # Chunks, joined once at the end: a growing bytearray is copied on reallocation (twice the size).
    chunks: list[bytes] = []
    size_so_far = position = 0
    try:
        while position < len(view) and not stream.eof:
            # One call's output is held twice while zstandard joins it: half of what is still allowed.
            allowed = (limit + 1 - size_so_far) // 2
            size = max(_MIN_SLICE, min(_MAX_SLICE, allowed // _DENSEST_OUTPUT * _DENSEST_INPUT))
            chunk = stream.decompress(view[position : position + size])
            position += size
            size_so_far += len(chunk)
            if size_so_far > limit:
                raise _too_large(limit, setting)
            chunks.append(chunk)
    except zstandard.ZstdError as exc:
        raise UnreadableBody(f"the body is not valid zstd: {exc}") from None
    if not stream.eof:
        raise UnreadableBody("the body is not valid zstd: the frame is cut short")
    trailing = len(stream.unused_data) + max(0, len(view) - position)
    if trailing:
        raise UnreadableBody(f"send one zstd frame: {trailing} bytes follow the first frame's end")
    return b"".join(chunks)
