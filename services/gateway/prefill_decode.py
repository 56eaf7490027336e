"""One placement of an engine request, and how its failures are classified.

    prefill.Prefill ──▶ first token ──▶ decode.Generate(kv_transfer_params) ──▶ ...
       └─ finish_reason set: done (the prefill instance freed the blocks; no decode call)
    no prefill instance (uncached part < local_prefill_threshold, or a failover):
       decode.Generate without kv_transfer_params (the decode prefills itself)
    either way, a peer holding more of the prompt (`Placement.peer`): its hint goes to the
       instance computing the prompt (PeerKV; docs/kv-tiers.md)

Any way out before the engine reports a finish (client gone, stop string hit, error) cancels
the open call and sends Abort to every instance it touched but the one that failed, so all
free the request's blocks at once (a prefill instance its pinned KV).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple

import grpc

from pdserve.services.gateway.channel_pool import ChannelPool
from pdserve.services.gateway.errors import GatewayError, from_grpc_error, model_not_found
from pdserve.services.gateway.placement import Placement
from pdserve.services.proto import engine_pb2

_NOT_FINISHED = engine_pb2.FINISH_REASON_UNSPECIFIED
_CODE = grpc.StatusCode
INSTANCE_FAILED = frozenset({_CODE.UNAVAILABLE, _CODE.CANCELLED, _CODE.INTERNAL,
                             _CODE.UNKNOWN})
"""Statuses that say the instance itself is unwell (gone, crashed, broke the stream): it is
marked failed and skipped until a health check says SERVING again. A CANCELLED we caused
never shows up as a status: our own cancel raises asyncio.CancelledError."""
TRANSFER_FAILED = frozenset({_CODE.ABORTED, _CODE.DATA_LOSS, _CODE.NOT_FOUND})
"""Generate statuses of a failed KV transfer (pin expired or released, a bad chunk): worth
another placement, but no verdict on any instance's health."""
RETRIABLE_PREFILL = INSTANCE_FAILED
"""Prefill statuses worth another placement. ABORTED is not one: it means the request was
aborted (an Abort call), and retrying would defeat the abort."""
RETRIABLE_GENERATE = INSTANCE_FAILED | TRANSFER_FAILED
"""Generate statuses worth another placement."""


def is_overloaded(error: grpc.aio.AioRpcError) -> bool:
    """A decode instance's admission queue is full (not a message over the size limit)."""
    return error.code() == _CODE.RESOURCE_EXHAUSTED and \
        "larger than max" not in (error.details() or "")


class AttemptFailed(Exception):
    """One placement of an engine request failed in a way another placement may not."""

    def __init__(self, address: str, role: str, error: grpc.aio.AioRpcError | str,
                 overloaded: bool = False) -> None:
        self.instance_failed = not overloaded and (not isinstance(error, grpc.aio.AioRpcError)
                                                   or error.code() in INSTANCE_FAILED)
        """Mark `address` failed in the health tracker (False: only this request failed)."""
        self.overloaded = overloaded
        """The instance was full: wait, then place again (outside the retry budget)."""
        if isinstance(error, grpc.aio.AioRpcError):
            error = f"{error.code().name}: {error.details()}"
        super().__init__(f"{role} {address}: {error}")
        self.address = address
        self.role = role


class EngineOutput(NamedTuple):
    """One step of one engine request, as the gateway consumes it."""

    token_ids: list[int]
    logprobs: list[engine_pb2.TokenLogprobs]
    """Aligned with token_ids when logprobs were requested, else empty."""
    finish_reason: int
    """engine_pb2.FinishReason; FINISH_REASON_UNSPECIFIED while running."""
    num_cached_tokens: int | None
    """Prefix-cache hit of the instance that computed the prompt (first output only)."""
    prompt_logprobs: list[engine_pb2.TokenLogprobs] | None = None
    """First output only, when sampling_params.prompt_logprobs was set: one per prompt
    token after the first (the first has no logprob)."""
    stop_reason: int | None = None
    """The stop_token_ids entry that ended the request (None for EOS, as in vLLM)."""


async def prefill_then_decode(
        channels: ChannelPool, placement: Placement,
        decode_req: engine_pb2.DecodeRequest, request_id: str,
        engine_prefix: str | None = None) -> AsyncIterator[EngineOutput]:
    """The outputs after `decode_req.output_token_ids` (tokens already handed out), from
    `placement`; `decode_req.request_id` is the attempt's engine request id, `engine_prefix`
    its HTTP request's (`ChannelPool.generate`).

    Raises:
        AttemptFailed: a retriable failure (the instance is at fault).
        GatewayError: any other engine error.
    """
    engine_request_id = decode_req.request_id
    used: list[tuple[str, str]] = []
    failed: str | None = None
    call = None
    finished = False
    # NOTE: the decode counts as loaded from placement on (requests placed meanwhile spread);
    # once its Generate call starts, the call counts itself (ChannelPool.generate)
    channels.in_flight.begin(placement.decode_address)
    placed_only = True
    try:
        if (address := placement.prefill_address) is not None:
            used.append((address, "prefill"))
            try:
                resp = await channels.prefill(address, engine_pb2.PrefillRequest(
                    request_id=engine_request_id, prompt_token_ids=decode_req.prompt_token_ids,
                    sampling_params=decode_req.sampling_params,
                    cache_salt=decode_req.cache_salt,
                    lora_request=decode_req.lora_request
                    if decode_req.HasField("lora_request") else None,
                    peer_kv=_peer_kv(placement)), request_id)
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRIABLE_PREFILL:
                    raise _adapter_gone(e, decode_req) or from_grpc_error(e, "Prefill") from None
                failed = address
                raise AttemptFailed(address, "prefill", e) from None
            finished = resp.finish_reason != _NOT_FINISHED
            yield EngineOutput([resp.first_token_id],
                               [resp.first_logprobs] if resp.HasField("first_logprobs") else [],
                               resp.finish_reason, resp.num_cached_tokens,
                               list(resp.prompt_logprobs) or None, _stop_reason(resp))
            if finished:
                return
            decode_req.output_token_ids.append(resp.first_token_id)
            decode_req.kv_transfer_params.CopyFrom(resp.kv_transfer_params)
        elif (peer_kv := _peer_kv(placement)) is not None:
            decode_req.peer_kv.CopyFrom(peer_kv)
        else:
            decode_req.ClearField("peer_kv")  # a retry's placement may name none
        address = placement.decode_address
        used.append((address, "decode"))
        try:
            call = channels.generate(address, decode_req, request_id, engine_prefix)
            channels.in_flight.end(address)
            placed_only = False
            is_first = placement.prefill_address is None
            async for chunk in call:
                finished = chunk.finish_reason != _NOT_FINISHED
                yield EngineOutput(list(chunk.token_ids), list(chunk.logprobs),
                                   chunk.finish_reason,
                                   chunk.num_cached_tokens if is_first else None,
                                   list(chunk.prompt_logprobs) or None, _stop_reason(chunk))
                is_first = False
                if finished:
                    return
        except grpc.aio.AioRpcError as e:
            # NOTE: a full decode when the client already has tokens (a started stream): a
            # 429 now would break it; wait for room instead (the failover loop).
            overloaded = is_overloaded(e) and bool(decode_req.output_token_ids)
            if (gone := _adapter_gone(e, decode_req)) is not None:
                raise gone from None
            if not overloaded and e.code() not in RETRIABLE_GENERATE:
                raise from_grpc_error(e, "Generate") from None
            failed = address
            raise AttemptFailed(address, "decode", e, overloaded=overloaded) from None
        failed = address
        raise AttemptFailed(address, "decode", "the stream ended without a finish reason")
    finally:
        # NOTE: no awaits here: this also runs when the task is being cancelled.
        if placed_only:
            channels.in_flight.end(placement.decode_address)
        if call is not None and not call.done():
            call.cancel()
        if not finished:
            for address, role in used:
                if address != failed:  # it ended the call itself, or is gone
                    channels.abort_soon(address, role, [engine_request_id], request_id)


def _adapter_gone(error: grpc.aio.AioRpcError,
                  decode_req: engine_pb2.DecodeRequest) -> GatewayError | None:
    """vLLM's 404 when the instance no longer has the request's LoRA adapter (unloaded
    since the gateway looked: services/common/lora.py's NOT_FOUND, or the engine's refusal
    of a request that raced the unload), else None."""
    details = error.details() or ""
    if not decode_req.HasField("lora_request") or not (
            (error.code() == _CODE.NOT_FOUND and details.startswith("LoRA adapter"))
            or (error.code() == _CODE.INVALID_ARGUMENT
                and details.startswith("lora_request: LoRA adapter")
                and "is not loaded" in details)):
        return None
    return model_not_found(decode_req.lora_request.lora_name)


def _peer_kv(placement: Placement) -> engine_pb2.PeerKV | None:
    """The placement's peer-tier hint for the instance computing the prompt."""
    peer = placement.peer
    return None if peer is None else engine_pb2.PeerKV(address=peer.address,
                                                       num_blocks=peer.num_blocks)


def _stop_reason(message: engine_pb2.PrefillResponse | engine_pb2.TokenChunk) -> int | None:
    return message.stop_reason if message.HasField("stop_reason") else None
