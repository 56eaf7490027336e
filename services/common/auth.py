"""The internal token: prefill and decode refuse PrefillService / DecodeService calls that
lack it (grpc.aio server interceptor); grpc.health.v1 stays open for probes.

    client metadata:  authorization: Bearer <token>
    missing / wrong:  UNAUTHENTICATED "missing or invalid internal token ..." (the handler
                      never runs, the request message is not deserialized)
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

AUTH_METADATA_KEY = "authorization"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)
"""Method prefixes that need no token (docker and launcher health probes)."""


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client adds to every call: `(("authorization", "Bearer <token>"),)`,
    or () without a token."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Require `authorization: Bearer <token>` on every method outside OPEN_SERVICES.

    The comparison is constant-time (hmac.compare_digest over the UTF-8 bytes).
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the internal token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(OPEN_SERVICES) or self._authorized(
                handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        return _refusing(handler, method)


def _refusing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    message = (f"missing or invalid internal token for {method}: send gRPC metadata "
               "'authorization: Bearer <token>' (--internal-token / PDSERVE_INTERNAL_TOKEN)")

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # NOTE: no deserializer: a refused call's payload is never parsed.
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            refuse, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            refuse, response_serializer=handler.response_serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            refuse, response_serializer=handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(
        refuse, response_serializer=handler.response_serializer)
