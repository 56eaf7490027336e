"""KVHolding: compute a prompt's KV, hold its blocks and serve them to another instance.

    hold(prompt) ──▶ engine request (max_tokens 1, kv_transfer_params=RemoteDecode())
                  │ finished: the scheduler holds its blocks (HeldBlocks) ──▶ KVHandle
    FetchKV(indices) ──▶ chunks gathered from the held blocks (start_send ... end_send)
    ReleaseKV / Abort / TTL expiry ──▶ connector.close ──▶ the scheduler frees them

Both roles hold: a prefill instance for its decode (`Prefill`), and any instance for a
peer that lacks a prefix it has cached (`PinKV`, the peer tier: docs/kv-tiers.md). A pin
is a hold of the prefix's tokens: the prefix cache (pool, or the disk tier) gives every
block but the last token's, so a pin computes one token and copies nothing.

The scheduler owns the blocks the whole time (docs/lifecycle.md); this worker only streams
them and translates. A request that ends at its first token (stop, max_tokens 1, the model's
length) asks for no transfer: its blocks are freed when it finishes. When a close (or the
end of the last FetchKV reading a closed one) leaves a transfer done, the free is queued on
the engine thread at once, so an op queued after (GetState) sees the blocks free.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from pdserve.services.common.errors import ServiceError
from pdserve.services.common.state_feed import TransferView
from pdserve.services.common.worker import EngineWorker
from pdserve.shared.engine.scheduler_output import EngineCoreOutput
from pdserve.shared.engine.trace import now_us
from pdserve.shared.kv_transfer.codec import KVChunkData, encode_kv_blocks
from pdserve.shared.kv_transfer.params import KVHandle, RemoteDecode
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.request import FinishReason, Request
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.stop_rules import at_length_limit

logger = logging.getLogger(__name__)


def _next_encoded(chunks: Iterator[KVChunkData],
                  encode: Callable[[KVChunkData], Any]) -> tuple[KVChunkData, Any] | None:
    chunk = next(chunks, None)
    return None if chunk is None else (chunk, encode(chunk))


class KVHolding(EngineWorker):
    """An engine worker that holds KV for other instances (prefill and decode roles)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv_connector = self.engine_core.kv_connector
        self._reaper = asyncio.get_running_loop().create_task(self._reap_expired())

    # -- hold / pin --------------------------------------------------------------------------

    async def hold(self, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams, cache_salt: str | None,
                   lora_request: LoRARequest | None = None, count: bool = True,
                   peer: Any = None) -> tuple[EngineCoreOutput, KVHandle | None]:
        """Compute the prompt's KV (what the prefix cache lacks), sample the first token.

        Returns:
            The engine's output with the first token and the client's finish reason (None
            when the request goes on in a decode); and, when it goes on, the `KVHandle` of
            the blocks held for the decode (else None). `count`: observe it in the metrics
            as a prefill (a pin is not one). `peer`: a peer holding the prompt's prefix
            (`kv_receiving.PeerHint`): fetched from it first (`_receive_peer`).

        Raises:
            ValueError: a bad prompt (the engine's message).
            ServiceError: ALREADY_EXISTS (request id in use), ABORTED (Abort came first).
        """
        # NOTE: ids are per instance. An id released a moment ago is taken once its blocks
        # are freed (ReleaseKV answers first).
        await self._wait_freed(request_id)
        if self.kv_connector.is_held(request_id):
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request {request_id!r} is already prefilled or in progress")
        # NOTE: min_tokens is capped, not dropped: min_tokens >= 1 still bans EOS / stop ids
        # for the first token, as in the single-process engine.
        engine_params = dataclasses.replace(params, n=1, max_tokens=1,
                                            min_tokens=min(params.min_tokens, 1))
        request = Request(request_id, list(prompt_token_ids), engine_params,
                          eos_token_id=self.eos_token_id, cache_salt=cache_salt,
                          lora_request=lora_request, block_hasher=None if peer is None
                          else self.engine_core.kv_cache_manager.block_hasher)
        # A request that cannot go on past its first token asks for no transfer.
        if not at_length_limit(params, self.max_model_len, request.num_prompt_tokens, 1):
            request.kv_transfer_params = RemoteDecode()
        arrival = time.monotonic()
        with self.active(request_id, "is already prefilled or in progress"):
            receive = None
            try:
                if peer is not None:
                    receive = await self._receive_peer(request, peer)
                last = None
                async for delta in self.engine.generate(request):
                    last = delta
                held = last.kv_transfer_params if last is not None else None
                if last is None or last.finish_reason == FinishReason.ABORT or \
                        (held is not None and not self.kv_connector.is_open(request_id)):
                    raise ServiceError(grpc.StatusCode.ABORTED,
                                       f"request {request_id!r} was aborted")
                first_token_time = time.monotonic()
                if count:
                    self.metrics.first_token(first_token_time - arrival)
                # The client's request goes on in a decode exactly when the connector holds
                # its blocks (it asked, not at the client's own limit, and hit max_tokens=1).
                finish = None if held is not None else last.finish_reason
                handle = None if held is None else KVHandle(
                    self.identity.address, held.block_hashes, request.num_prompt_tokens,
                    self.layout, self.model_name, self.quantization,
                    lora_request.lora_name if lora_request else "",
                    lora_request.lora_int_id if lora_request else 0)
                if count:
                    self.metrics.request_finished(
                        "transferred" if finish is None else finish.value,
                        request.num_prompt_tokens, 1, first_token_time - arrival)
                return last._replace(finish_reason=finish), handle
            except BaseException:
                # NOTE: generate() has aborted the engine request (awaited): it is either
                # gone or finished and held for a transfer nobody will fetch now.
                self._close(request_id)
                raise
            finally:
                if receive is not None:
                    await self._end_receive(receive)

    async def _receive_peer(self, request: Request, peer: Any) -> Any:
        """Start fetching the prefix `peer` holds into `request`'s blocks; the receive, or
        None: the prompt is computed here. A worker that only holds computes it always;
        `KVReceiving` (kv_receiving.py) fetches."""
        return None

    async def _end_receive(self, receive: Any) -> None:
        """The request is done: end its receive and release the peer's pin (`KVReceiving`;
        never called here, where `_receive_peer` starts none)."""

    async def pin(self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None,
                  lora_request: LoRARequest | None = None) -> KVHandle:
        """PinKV: hold the KV of a peer's prompt prefix (`prompt_token_ids`: its first k full
        blocks and one token more) until the peer's FetchKV and ReleaseKV (or the TTL).

        The prefix cache gives the k blocks (from the pool, or loaded from the disk tier);
        the token after them is computed (a held request always computes one), so a pin of
        a prefix this instance no longer holds still answers, at a prefill's cost.

        Returns:
            The handle of the held blocks (k + 1 of them; num_tokens k * block_size + 1).

        Raises:
            ValueError: a bad prompt. ServiceError: ALREADY_EXISTS (id in use),
                FAILED_PRECONDITION (the prefix reaches the model's length: nothing held).
        """
        # NOTE: max_tokens 2: as a client's request that goes on past its first token (the
        # engine request itself stops at one).
        # The peer waits on it: first under --scheduling-policy priority.
        policy = self.engine_core.scheduler.scheduler_config.scheduling_policy
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                priority=-(1 << 20) if policy == "priority" else 0)
        _, handle = await self.hold(request_id, prompt_token_ids, params, cache_salt,
                                    lora_request, count=False)
        if handle is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"PinKV: nothing held for request {request_id!r} (the prefix "
                               "reaches the model's length)")
        self.metrics.tier_metrics().peer_served(len(handle.block_hashes))
        return handle

    # -- FetchKV / ReleaseKV / Abort ---------------------------------------------------------

    async def fetch_kv(self, request_id: str, block_indices: list[int],
                       encode: Callable[[KVChunkData], Any]) -> AsyncIterator[Any]:
        """Stream the held KV of `block_indices` (all blocks when empty), as
        `encode(chunk)` for each chunk (the servicer's proto message).

        Raises:
            ServiceError: NOT_FOUND (not held: never prefilled, released, aborted or
                expired), INVALID_ARGUMENT (an index out of range or repeated), ABORTED (the
                transfer was released or aborted during the stream).
        """
        block_ids = self.kv_connector.start_send(request_id)
        if block_ids is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND,
                               f"no pinned KV for request {request_id!r} (never prefilled here, "
                               "already released or aborted, or expired after "
                               f"{self.config.kv_pin_ttl:g} s)")
        pending: asyncio.Future | None = None
        try:
            num_blocks = len(block_ids)
            indices = list(block_indices) or list(range(num_blocks))
            bad = next((i for i in indices if not 0 <= i < num_blocks), None)
            if bad is not None:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"block_indices: index {bad} is out of range [0, {num_blocks})")
            if len(set(indices)) != len(indices):
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "block_indices: an index is repeated")
            start, start_us = time.monotonic(), now_us()
            chunks = encode_kv_blocks(self.engine_core.model_runner.kv_caches, block_ids,
                                      indices, self.config.kv_chunk_bytes)
            # NOTE: the next chunk is gathered and encoded in a worker thread (torch and the
            # copies drop the GIL) while gRPC sends this one. Reading held blocks off the
            # engine thread is safe: nothing writes a block while a request holds it, and
            # the scheduler frees them only after end_send.
            pending = asyncio.ensure_future(asyncio.to_thread(_next_encoded, chunks, encode))
            while (item := await pending) is not None:
                pending = asyncio.ensure_future(asyncio.to_thread(_next_encoded, chunks, encode))
                if not self.kv_connector.is_open(request_id):
                    raise ServiceError(grpc.StatusCode.ABORTED,
                                       f"request {request_id!r} was released or aborted during "
                                       "the transfer")
                chunk, message = item
                done = chunk.layer_start + chunk.shape[0] == self.layout.num_layers
                self.metrics.kv_sent(len(chunk.block_indices) if done else 0, len(chunk.data))
                yield message
            self.metrics.kv_transfer(time.monotonic() - start)
            if self.engine.tracer is not None:
                self.engine.tracer.complete("kv_send", "kv", start_us, now_us(), {
                    "request_id": request_id, "blocks": len(indices)})
        finally:
            # NOTE: no await here: a cancelled RPC can be cancelled again while it unwinds
            # (gRPC fails the write, then cancels the task), and any await may raise.
            self.spawn(self._end_send_after(request_id, pending))

    async def release(self, request_id: str) -> bool:
        """Unpin; False when nothing was held (released, aborted or expired already).
        Answers at once: the blocks are freed by an engine op before the next step."""
        return self._close(request_id)

    def close_held(self, request_ids: list[str]) -> list[str]:
        """Close the held transfers among `request_ids` (Abort); the ids it closed."""
        return [r for r in request_ids if self._close(r)]

    def _close(self, request_id: str) -> bool:
        """Close the transfer (no FetchKV can start on it); queue the free of its blocks
        now when no FetchKV reads them, else their last reader does."""
        was_open, done = self.kv_connector.close(request_id)
        if done:
            self._free_done()
        return was_open

    async def _end_send_after(self, request_id: str, gather: asyncio.Future | None) -> None:
        """End a FetchKV once its last chunk gather is done (never free under a reader)."""
        if gather is not None:
            await asyncio.gather(gather, return_exceptions=True)
        if self.kv_connector.end_send(request_id):
            self._free_done()

    def _free_done(self) -> None:
        """Queue the scheduler's free of the transfers now done (an engine op)."""
        self.engine.submit(lambda e: e.scheduler.update_from_kv_xfer_finished())

    async def _wait_freed(self, request_id: str) -> None:
        """Until a closed transfer of `request_id` is freed (at most rpc_timeout)."""
        deadline = time.monotonic() + self.config.rpc_timeout
        while self.kv_connector.is_held(request_id) and \
                not self.kv_connector.is_open(request_id) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def _reap_expired(self) -> None:
        """Close the transfers nobody fetched or released within the TTL."""
        period = min(1.0, self.config.kv_pin_ttl / 4)
        while True:
            await asyncio.sleep(period)
            for request_id in self.kv_connector.expired(self.config.kv_pin_ttl):
                logger.info("[%s] KV pin expired after %g s without a release", request_id,
                            self.config.kv_pin_ttl)
                self._close(request_id)

    # -- audit -------------------------------------------------------------------------------

    def pinned_block_ids(self) -> frozenset[int]:
        """Blocks held for transfers."""
        return frozenset(b for s in self.kv_connector.sending() for b in s.block_ids)

    def transfers(self) -> list[TransferView]:
        """Sends in flight (a FetchKV reads the blocks now)."""
        now = time.monotonic()
        return [TransferView(s.request.request_id, "send", "", len(s.block_ids),
                             now - s.fetch_started)
                for s in self.kv_connector.sending() if s.num_fetches]

    async def close(self) -> None:
        self._reaper.cancel()
        await asyncio.gather(self._reaper, return_exceptions=True)
        await super().close()
