"""What the Tinker front checks before a body is read, without the ``tinker`` SDK (which imports
torch: the web server does not load it until a request needs the protobuf schema,
training.wire.tinker)."""

from __future__ import annotations

PROTOBUF = "application/x-protobuf"


class WireError(ValueError):
    """A request body that is not what the API takes: ``param`` names the part."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
