"""ServiceError and the mapping of worker exceptions to gRPC status codes."""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from pdserve.shared.engine.slo_budget import TTFTUnreachableError
from pdserve.shared.kv_transfer.codec import KVCodecError

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    """A failure with a definite gRPC status; the message goes to the client as is."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message) for an exception raised by a worker.

    ValueError (bad input: sampling params, prompt, KV handle) is INVALID_ARGUMENT with its
    own text; a prompt refused by early rejection (TTFTUnreachableError) is RESOURCE_EXHAUSTED
    (the gateway's retryable 429); anything unexpected is INTERNAL (and logged with its
    traceback by the caller).
    """
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    if isinstance(exc, TTFTUnreachableError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, KVCodecError):
        return grpc.StatusCode.DATA_LOSS, f"bad KV chunk: {exc}"
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception, request_id: str,
                     method: str) -> NoReturn:
    """End the RPC with the status `exc` maps to (raises, as context.abort does)."""
    code, message = to_status(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("[%s] %s failed", request_id, method, exc_info=exc)
    else:
        logger.info("[%s] %s: %s %s", request_id, method, code.name, message)
    await context.abort(code, message)
    raise AssertionError("context.abort returned")
