"""Internal gRPC: the one way to open a channel to a prefill or decode instance, and the
internal token, which prefill and decode require on PrefillService / DecodeService calls
(grpc.aio server interceptor); grpc.health.v1 stays open for probes.

    client metadata:  x-request-id: <id> (optional), authorization: Bearer <token>
    missing / wrong:  UNAUTHENTICATED "missing or invalid internal token ..." (the handler
                      never runs, the request message is not deserialized)
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

from pdserve.shared.config import (
    MAX_GRPC_MESSAGE_BYTES,
    grpc_keepalive_channel_options,
    grpc_reconnect_options,
)

AUTH_METADATA_KEY = "authorization"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)
"""Method prefixes that need no token (docker and launcher health probes)."""
Metadata = tuple[tuple[str, str], ...]


def channel_options(max_message_bytes: int = MAX_GRPC_MESSAGE_BYTES,
                    keepalive_s: float | None = None) -> list[tuple[str, int]]:
    """Message limits (bytes, both ways), reconnect backoff (GRPC_RECONNECT_BACKOFF_MS) and a
    keepalive ping every `keepalive_s` s (default GRPC_KEEPALIVE_S): shared/config.py."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            *grpc_reconnect_options(), *grpc_keepalive_channel_options(keepalive_s)]


def internal_channel(address: str, **options) -> grpc.aio.Channel:
    """A channel to a prefill or decode instance (`host:port`) with `channel_options(**options)`;
    every call on it sends `call_metadata(token, ...)`."""
    return grpc.aio.insecure_channel(address, options=channel_options(**options))


def internal_sync_channel(address: str) -> grpc.Channel:
    """The blocking twin of `internal_channel` (the launcher's and the CLI's health probes)."""
    return grpc.insecure_channel(address, options=channel_options())


def call_metadata(token: str | None, request_id: str | None = None) -> Metadata:
    """`x-request-id` (the HTTP request's, for the instances' logs) when given, then
    `authorization: Bearer <token>` when there is a token."""
    rid = (("x-request-id", request_id),) if request_id is not None else ()
    return rid + ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else rid


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
    make = (grpc.unary_unary_rpc_method_handler if handler.unary_unary is not None else
            grpc.unary_stream_rpc_method_handler if handler.unary_stream is not None else
            grpc.stream_unary_rpc_method_handler if handler.stream_unary is not None else
            grpc.stream_stream_rpc_method_handler)
    return make(refuse, response_serializer=handler.response_serializer)
