"""OpenAI error objects: one exception type for every refusal, and the gRPC status mapping.

Body shape (what the `openai` client parses):

    {"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": 400}}
"""

from __future__ import annotations

from http import HTTPStatus

import grpc
from starlette.responses import JSONResponse

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}

# gRPC status -> HTTP status, per docs/services-contracts.md.
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.NOT_FOUND: 503,
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.ABORTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class GatewayError(Exception):
    """A refusal that becomes an OpenAI error object with `status_code`."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.err_type = err_type or _ERROR_TYPES.get(status_code) or HTTPStatus(
            status_code).phrase.replace(" ", "") + "Error"

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status_code}}


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(message, 400, param)


def model_not_found(model: str) -> GatewayError:
    return GatewayError(f"The model `{model}` does not exist.", 404, "model")


def no_backend(detail: str = "no prefill/decode instance is serving") -> GatewayError:
    return GatewayError(f"Service unavailable: {detail}.", 503)


def from_grpc_error(err: grpc.aio.AioRpcError, where: str) -> GatewayError:
    """Map a failed engine call to the status the client sees (never a 5xx for bad input)."""
    code = err.code()
    status = _GRPC_TO_HTTP.get(code, 500)
    detail = err.details() or code.name
    # gRPC's own RESOURCE_EXHAUSTED for a message over the channel's size limit ("Received
    # message larger than max (N vs. M)"): not an overload, the same request would fail
    # again, so never a retryable 429.
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in detail.lower():
        return GatewayError(f"The response would exceed the internal message limit ({where}: "
                            f"{detail}); ask for fewer prompt logprobs or a shorter prompt.",
                            400)
    if status == 429:
        return GatewayError(f"The server is overloaded ({where}: {detail}); retry later.", 429)
    if status == 400:
        return GatewayError(detail, 400)
    return GatewayError(f"{where} failed: {code.name}: {detail}", status)


def error_response(err: GatewayError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers=headers)
