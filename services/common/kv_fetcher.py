"""KVFetcher: pulls a request's missing KV blocks from a prefill instance (or a peer) into
this cache.

    FetchKV(request_id, block_indices) ──▶ KVChunk stream ──▶ TransferTracker.accept
        (dtype, shape, length, indices checked) ──▶ write_kv_blocks(our block ids)
    then ReleaseKV(request_id), in the background, with a deadline.

One gRPC channel per prefill address, created on first use, with the explicit message limits,
a short reconnect backoff and keepalive pings (a frozen or partitioned prefill fails the
transfer within seconds, not at `kv_transfer_timeout`); every call carries the internal token
(if configured) and `x-request-id`.

A FetchKV that fails UNAVAILABLE before its first chunk (a channel still in reconnect
backoff, failing calls at once, after the prefill or this host came back from a restart or
a network cut) waits up to RECONNECT_WAIT_S for the channel to connect and is asked once more.

A peer (the peer tier: docs/kv-tiers.md) is asked over KVPeerService (`PinKV`, then the
same FetchKV and ReleaseKV); a prefill over PrefillService.

Every FetchKV failure but NOT_FOUND (pin expired or released) and DATA_LOSS (a bad or missing
chunk) becomes ABORTED naming the prefill and its status: Generate's caller must not take the
prefill's UNAVAILABLE (or INTERNAL, ...) for this decode instance's failure. ABORTED, DATA_LOSS
and NOT_FOUND from Generate mean "the transfer failed": the gateway places the request again
without a health verdict on any instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc

from pdserve.services.common.auth import call_metadata, internal_channel
from pdserve.services.common.config import ServiceConfig
from pdserve.services.common.convert import handle_from_proto
from pdserve.services.common.errors import ServiceError
from pdserve.services.common.metrics import ServiceMetrics
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from pdserve.shared.config import GRPC_RECONNECT_BACKOFF_MS
from pdserve.shared.engine.trace import Tracer, now_us
from pdserve.shared.kv_transfer.codec import (
    KVCaches,
    KVChunkData,
    KVCodecError,
    KVLayout,
    TransferTracker,
    write_kv_blocks,
)
from pdserve.shared.kv_transfer.params import KVHandle

logger = logging.getLogger(__name__)

_PASSED_THROUGH = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS})
"""FetchKV statuses Generate answers as they are; every other one becomes ABORTED."""
RECONNECT_WAIT_S = GRPC_RECONNECT_BACKOFF_MS[1] / 1000 + 1.0
"""Seconds a FetchKV that failed UNAVAILABLE before its first chunk waits for the channel
to connect before its one retry: past the largest reconnect backoff, so a prefill that is
reachable again is found, and a gone one costs only this long."""


PIN_TIMEOUT_S = 2.0
"""Seconds a PinKV may take (at most the service's rpc_timeout): a pin queues in the
holder's scheduler like any request, and a holder too busy to pin within this long is not
worth waiting for (the prompt is computed here instead)."""


class KVFetcher:
    def __init__(self, kv_caches: KVCaches, config: ServiceConfig,
                 metrics: ServiceMetrics, tracer: Tracer | None = None) -> None:
        self.kv_caches = kv_caches
        self.tracer = tracer
        """The engine's opt-in timeline: one `kv_fetch` span per transfer."""
        self.layout = KVLayout.of(kv_caches)
        self.config = config
        self.metrics = metrics
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.in_flight: dict[str, tuple[str, int, float]] = {}
        """request_id -> (prefill address, blocks, monotonic start) of fetches running now."""

    def _stub(self, address: str, peer: bool = False
              ) -> engine_pb2_grpc.PrefillServiceStub | engine_pb2_grpc.KVPeerServiceStub:
        """The stub of `address` (one channel per address): KVPeerService's for a `peer`,
        else PrefillService's."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = internal_channel(
                address, max_message_bytes=self.config.max_message_bytes)
        return (engine_pb2_grpc.KVPeerServiceStub if peer
                else engine_pb2_grpc.PrefillServiceStub)(channel)

    async def pin(self, request_id: str, address: str, prompt_token_ids: Sequence[int],
                  cache_salt: str | None, lora_request: pb.LoRAAdapter | None) -> KVHandle:
        """PinKV at the peer `address`: the handle of the prefix's blocks it holds for us
        (`peer=True`).

        Raises:
            ServiceError: ABORTED naming the peer and its status (any failure).
        """
        try:
            resp = await self._stub(address, peer=True).PinKV(
                pb.PinKVRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                cache_salt=cache_salt or "", lora_request=lora_request),
                timeout=min(PIN_TIMEOUT_S, self.config.rpc_timeout),
                metadata=call_metadata(self.config.internal_token, request_id))
        except grpc.aio.AioRpcError as e:
            raise ServiceError(grpc.StatusCode.ABORTED, f"PinKV at peer {address} failed: "
                               f"{e.code().name}: {e.details()}") from None
        return handle_from_proto(resp.kv_transfer_params)._replace(peer=True)

    async def fetch(self, request_id: str, address: str, block_indices: Sequence[int],
                    dst_block_ids: Sequence[int], peer: bool = False) -> None:
        """Write the blocks `block_indices` (positions in the request's block list) that the
        prefill instance (or `peer`) at `address` holds for `request_id` into our blocks
        `dst_block_ids`.

        Raises:
            ServiceError: NOT_FOUND (no pinned KV: expired, released, aborted) and DATA_LOSS
                (its status, a chunk that does not fit, a stream that ends early) as they
                are; ABORTED, naming the prefill address and its status, for any other
                FetchKV failure (unreachable, gone mid-stream, deadline, auth, ...).
        """
        tracker = TransferTracker(self.layout, block_indices)
        dst = dict(zip(block_indices, dst_block_ids))
        start, start_us = time.monotonic(), now_us()
        self.in_flight[request_id] = (address, len(block_indices), start)
        try:
            for attempt in range(2):
                try:
                    await self._fetch_once(address, request_id, block_indices, tracker, dst,
                                           peer)
                    break
                except grpc.aio.AioRpcError as e:
                    if attempt == 0 and e.code() is grpc.StatusCode.UNAVAILABLE and \
                            not tracker.num_bytes and await self._reconnected(address):
                        continue
                    code = e.code() if e.code() in _PASSED_THROUGH else grpc.StatusCode.ABORTED
                    raise ServiceError(code, f"FetchKV from prefill {address} failed: "
                                       f"{e.code().name}: {e.details()}") from None
        except KVCodecError as e:
            raise ServiceError(grpc.StatusCode.DATA_LOSS,
                               f"bad KV chunk from prefill {address}: {e}") from None
        finally:
            self.in_flight.pop(request_id, None)
        if not tracker.complete:
            raise ServiceError(grpc.StatusCode.DATA_LOSS,
                               f"truncated KV transfer from prefill {address}: "
                               f"{tracker.num_missing_blocks} of {len(block_indices)} blocks "
                               "never arrived")
        self.metrics.kv_received(len(block_indices), tracker.num_bytes)
        self.metrics.kv_transfer(time.monotonic() - start)
        if self.tracer is not None:
            self.tracer.complete("kv_fetch", "kv", start_us, now_us(), {
                "request_id": request_id, "blocks": len(block_indices),
                "bytes": tracker.num_bytes})

    async def _fetch_once(self, address: str, request_id: str, block_indices: Sequence[int],
                          tracker: TransferTracker, dst: dict[int, int], peer: bool) -> None:
        call = self._stub(address, peer).FetchKV(
            pb.FetchKVRequest(request_id=request_id, block_indices=block_indices),
            timeout=self.config.kv_transfer_timeout,
            metadata=call_metadata(self.config.internal_token, request_id))
        try:
            async for chunk in call:
                if chunk.request_id != request_id:
                    raise KVCodecError(f"chunk is for request {chunk.request_id!r}")
                data = tracker.accept(KVChunkData(list(chunk.block_indices), chunk.layer_start,
                                                  chunk.dtype, tuple(chunk.shape), chunk.data))
                write_kv_blocks(self.kv_caches, [dst[i] for i in chunk.block_indices],
                                chunk.layer_start, data)
        finally:
            if not call.done():
                call.cancel()

    async def _reconnected(self, address: str) -> bool:
        """Whether the channel to `address` connects within RECONNECT_WAIT_S."""
        channel = self._channels[address]
        try:
            await asyncio.wait_for(channel.channel_ready(), RECONNECT_WAIT_S)
        except (TimeoutError, grpc.aio.AioRpcError):
            return False
        logger.info("channel to prefill %s reconnected; fetching again", address)
        return True

    async def release(self, request_id: str, address: str, peer: bool = False) -> None:
        """ReleaseKV at `address`; failures are logged (the holder's TTL unpins anyway)."""
        try:
            await self._stub(address, peer).ReleaseKV(
                pb.ReleaseKVRequest(request_id=request_id), timeout=self.config.rpc_timeout,
                metadata=call_metadata(self.config.internal_token, request_id))
        except grpc.aio.AioRpcError as e:
            logger.warning("[%s] ReleaseKV on %s failed: %s %s", request_id, address,
                           e.code().name, e.details())

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self._channels.values()),
                             return_exceptions=True)
        self._channels.clear()
