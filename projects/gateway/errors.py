"""The gateway's error: OpenAI's error object (from the table the API and the inference server
share, training.wire.openai_errors), with ``Retry-After`` where the client should come back later."""

from __future__ import annotations

from django.http import JsonResponse

from training.wire.openai_errors import error_object


class GatewayError(Exception):
    """A request the gateway answers itself, with an error, instead of a server's reply."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After

    def response(self) -> JsonResponse:
        response = JsonResponse(error_object(self.status, self.message, code=self.code, param=self.param),
                                status=self.status)  # fmt: skip
        if self.retry_after is not None:
            response["Retry-After"] = str(self.retry_after)
        return response
