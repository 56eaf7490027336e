"""PrefillWorker: prefill a prompt, sample its first token, pin its KV blocks for the decode.

    Prefill ──▶ engine request (max_tokens 1) ──▶ finished, blocks held ──▶ Pin ──▶ KVHandle
                                                                            │
    FetchKV(indices) ──▶ chunks gathered from the pinned blocks ◀───────────┤
    ReleaseKV / Abort / TTL expiry ──▶ kv_cache_manager.free (engine thread) ◀┘

The engine core runs with `hold_finished_blocks=True`: a finished request keeps its blocks
until this worker frees them. Every path that does not hand the blocks to a Pin frees them
(shielded from cancellation), and every Pin ends in exactly one free: a released, aborted or
expired pin is taken out of `_pins` at once, and freed when its last FetchKV stream ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from services.common.errors import ServiceError
from services.common.state_feed import TransferView
from services.common.worker import EngineWorker, free_unscheduled_op
from shared.engine.engine_core import EngineCore
from shared.kv_transfer.codec import KVChunkData, encode_kv_blocks
from shared.kv_transfer.handle import KVHandle
from shared.request import FinishReason, Request, RequestStatus, TokenLogprobs
from shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PrefillResult(NamedTuple):
    request_id: str
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    finish_reason: FinishReason | None
    """Set when the first token already ends the request (no handle then: blocks freed)."""
    num_cached_tokens: int
    handle: KVHandle | None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With sampling_params.prompt_logprobs: one per prompt token, the first None."""


@dataclass(slots=True)
class Pin:
    """A finished prefill's blocks, held for the decode side."""

    request: Request
    block_ids: list[int]
    expires_at: float
    num_fetches: int = 0
    """FetchKV streams reading the blocks now."""
    closed: bool = False
    """Released, aborted or expired: the last FetchKV stream frees the blocks."""
    fetch_started: float = 0.0
    """Monotonic start of the latest FetchKV stream (state feed)."""
    free_queued: bool = False
    """The free of its blocks is queued on the engine thread: an engine op queued from now
    on (GetState's, the state feed's) runs after it and sees the blocks free, so the audit
    views count the pin no more (it stays in `_closing`, its id taken, until freed)."""


@dataclass(slots=True)
class _InFlight:
    request: Request
    aborted: bool = False


def _held_blocks_op(engine: EngineCore, request: Request) -> tuple[list[int], list[bytes]]:
    kv = engine.kv_cache_manager
    num_full = request.num_prompt_tokens // kv.block_size
    return kv.get_block_ids(request.request_id), kv.get_block_hashes(request)[:num_full]


def _same(chunk: KVChunkData) -> KVChunkData:
    return chunk


def _next_encoded(chunks: Iterator[KVChunkData],
                  encode: Callable[[KVChunkData], Any]) -> tuple[KVChunkData, Any] | None:
    chunk = next(chunks, None)
    return None if chunk is None else (chunk, encode(chunk))


def client_finish_reason(request: Request, params: SamplingParams,
                         max_model_len: int) -> FinishReason | None:
    """Whether the client's request ends with its first token (the engine ran max_tokens=1)."""
    if request.status == RequestStatus.FINISHED_STOPPED:
        return FinishReason.STOP
    if request.status == RequestStatus.FINISHED_ABORTED:
        return FinishReason.ABORT
    if params.max_tokens == 1 or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pins: dict[str, Pin] = {}
        self._closing: dict[str, Pin] = {}
        """Released / aborted / expired pins not freed yet (a FetchKV stream still reads
        them, or the free op waits for the step in flight)."""
        self._in_flight: dict[str, _InFlight] = {}
        self._reaper = asyncio.get_running_loop().create_task(self._reap_expired())

    # -- Prefill -----------------------------------------------------------------------------

    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, cache_salt: str | None) -> PrefillResult:
        """Compute the prompt's KV (what the prefix cache lacks), sample the first token.

        Raises:
            ValueError: a bad prompt (the engine's message).
            ServiceError: ALREADY_EXISTS (request id in use), ABORTED (Abort came first).
        """
        # NOTE: ids are per instance: a stale pin of the same id would free our blocks. An id
        # released a moment ago is taken once its blocks are freed (ReleaseKV answers first).
        await self._wait_freed(request_id)
        if request_id in self._in_flight or request_id in self._pins \
                or request_id in self._closing:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request {request_id!r} is already prefilled or in progress")
        # NOTE: min_tokens is capped, not dropped: min_tokens >= 1 still bans EOS / stop ids
        # for the first token, as in the single-process engine.
        engine_params = dataclasses.replace(params, n=1, max_tokens=1,
                                            min_tokens=min(params.min_tokens, 1))
        request = Request(request_id, list(prompt_token_ids), engine_params,
                          eos_token_id=self.eos_token_id, cache_salt=cache_salt)
        state = self._in_flight[request_id] = _InFlight(request)
        arrival = time.monotonic()
        pinned = False
        try:
            last = None
            async for delta in self.engine.generate(request):
                last = delta
            if state.aborted or last is None or last.finish_reason == FinishReason.ABORT:
                raise ServiceError(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted")
            first_token_time = time.monotonic()
            self.metrics.first_token(first_token_time - arrival)
            finish = client_finish_reason(request, params, self.max_model_len)
            handle = None
            if finish is None:
                block_ids, block_hashes = await self.engine.call(
                    lambda e: _held_blocks_op(e, request))
                if state.aborted:
                    raise ServiceError(grpc.StatusCode.ABORTED,
                                       f"request {request_id!r} was aborted")
                self._pins[request_id] = Pin(request, block_ids,
                                             time.monotonic() + self.config.kv_pin_ttl)
                pinned = True
                handle = KVHandle(self.identity.instance_id, self.identity.address, block_ids,
                                  block_hashes, request.num_prompt_tokens, self.layout,
                                  self.model_name, self.quantization)
            self.metrics.request_finished(
                "transferred" if finish is None else finish.value,
                request.num_prompt_tokens, 1, first_token_time - arrival)
            return PrefillResult(request_id, last.new_token_ids[0],
                                 last.new_logprobs[0] if last.new_logprobs else None, finish,
                                 max(request.num_cached_tokens, 0), handle,
                                 last.prompt_logprobs)
        finally:
            try:
                if not pinned:
                    await asyncio.shield(
                        self.engine.call(lambda e: free_unscheduled_op(e, request)))
            finally:
                self._in_flight.pop(request_id, None)

    # -- FetchKV / ReleaseKV / Abort ---------------------------------------------------------

    async def fetch_kv(self, request_id: str, block_indices: list[int],
                       encode: Callable[[KVChunkData], Any] = _same) -> AsyncIterator[Any]:
        """Stream the pinned KV of `block_indices` (all blocks when empty), as
        `encode(chunk)` for each chunk (the servicer's proto message).

        Raises:
            ServiceError: NOT_FOUND (no pin: never prefilled, released, aborted or expired),
                INVALID_ARGUMENT (an index out of range or repeated), ABORTED (the pin was
                released or aborted during the stream).
        """
        pin = self._pins.get(request_id)
        if pin is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND,
                               f"no pinned KV for request {request_id!r} (never prefilled here, "
                               "already released or aborted, or expired after "
                               f"{self.config.kv_pin_ttl:g} s)")
        num_blocks = len(pin.block_ids)
        indices = list(block_indices) or list(range(num_blocks))
        bad = next((i for i in indices if not 0 <= i < num_blocks), None)
        if bad is not None:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"block_indices: index {bad} is out of range [0, {num_blocks})")
        if len(set(indices)) != len(indices):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               "block_indices: an index is repeated")
        pin.num_fetches += 1
        start = pin.fetch_started = time.monotonic()
        chunks = encode_kv_blocks(self.engine.engine.model_runner.kv_caches, pin.block_ids,
                                  indices, self.config.kv_chunk_bytes)
        # NOTE: the next chunk is gathered and encoded in a worker thread (torch and the
        # copies drop the GIL) while gRPC sends this one. Reading pinned blocks off the engine
        # thread is safe: nothing writes a block while a request holds it, and full blocks
        # are never rewritten.
        pending = asyncio.ensure_future(asyncio.to_thread(_next_encoded, chunks, encode))
        try:
            while (item := await pending) is not None:
                pending = asyncio.ensure_future(asyncio.to_thread(_next_encoded, chunks, encode))
                if pin.closed:
                    raise ServiceError(grpc.StatusCode.ABORTED,
                                       f"request {request_id!r} was released or aborted during "
                                       "the transfer")
                chunk, message = item
                done = chunk.layer_start + chunk.shape[0] == self.layout.num_layers
                self.metrics.kv_sent(len(chunk.block_indices) if done else 0, len(chunk.data))
                yield message
            self.metrics.kv_transfer(time.monotonic() - start)
        finally:
            # NOTE: no await before the bookkeeping: a cancelled RPC can be cancelled again
            # while it unwinds (gRPC fails the write, then cancels the task), and any await
            # here may raise.
            pin.num_fetches -= 1
            if pin.closed and pin.num_fetches == 0:
                self.spawn(self._free_after(pin, pending))

    async def release(self, request_id: str) -> bool:
        """Unpin; False when there was no pin (released, aborted or expired already). Answers
        at once: the blocks are freed by an engine op before the next step."""
        return self._close(request_id)

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Abort prefills in flight and unpin finished ones, without waiting for the engine
        thread (a prefill's uncomputed chunks are dropped before the next step)."""
        aborted = []
        running = []
        for request_id in request_ids:
            state = self._in_flight.get(request_id)
            if state is not None:
                state.aborted = True
                running.append(request_id)
                aborted.append(request_id)
            elif self._close(request_id):
                aborted.append(request_id)
        if running:
            self.engine.request_abort(running)
        return aborted

    def _close(self, request_id: str) -> bool:
        """Take the pin out of `_pins` (no FetchKV can start on it); its blocks count as
        pinned, in `_closing`, until freed: now (an engine op, not awaited) or by its last
        FetchKV stream."""
        pin = self._pins.pop(request_id, None)
        if pin is None:
            return False
        pin.closed = True
        self._closing[request_id] = pin
        if pin.num_fetches == 0:
            self._free(pin)
        return True

    async def _free_after(self, pin: Pin, gather: asyncio.Future) -> None:
        """Free once the last chunk gather is done (never free blocks under a reader)."""
        await asyncio.gather(gather, return_exceptions=True)
        self._free(pin)

    def _free(self, pin: Pin) -> None:
        """Queue the free of the pin's blocks (an engine op, queued now: a GetState asked
        after this sees them freed); the pin leaves `_closing` once the op has run."""
        request = pin.request
        pin.free_queued = True
        freed = self.engine.submit(lambda e: e.kv_cache_manager.free(request))
        self.spawn(self._forget_when_freed(request.request_id, freed))

    async def _wait_freed(self, request_id: str) -> None:
        """Until a released pin of `request_id` is freed (at most rpc_timeout)."""
        deadline = time.monotonic() + self.config.rpc_timeout
        while request_id in self._closing and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def _forget_when_freed(self, request_id: str, freed: asyncio.Future) -> None:
        try:
            await asyncio.shield(freed)
        finally:
            self._closing.pop(request_id, None)

    async def _reap_expired(self) -> None:
        """Unpin handles nobody fetched or released within the TTL."""
        period = min(1.0, self.config.kv_pin_ttl / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            expired = [rid for rid, pin in self._pins.items()
                       if pin.expires_at <= now and pin.num_fetches == 0]
            for request_id in expired:
                logger.info("[%s] KV pin expired after %g s without a release", request_id,
                            self.config.kv_pin_ttl)
                self._close(request_id)

    # -- audit -------------------------------------------------------------------------------

    def num_pinned_blocks(self) -> int:
        return len(self.pinned_block_ids())

    def _held_pins(self) -> dict[str, Pin]:
        """Pins whose blocks an engine op queued now would still see pinned."""
        return {rid: pin for pins in (self._pins, self._closing) for rid, pin in pins.items()
                if not pin.free_queued}

    def pinned_block_ids(self) -> frozenset[int]:
        return frozenset(b for pin in self._held_pins().values() for b in pin.block_ids)

    def request_labels(self) -> dict[str, tuple[str, Request | None]]:
        return {rid: ("pinned", pin.request) for rid, pin in self._held_pins().items()}

    def transfers(self) -> list[TransferView]:
        now = time.monotonic()
        return [TransferView(rid, "send", "", len(pin.block_ids), now - pin.fetch_started)
                for rid, pin in self._held_pins().items() if pin.num_fetches]

    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def owned_request_ids(self) -> set[str]:
        return set(self._in_flight) | set(self._pins) | set(self._closing)

    async def close(self) -> None:
        self._reaper.cancel()
        await asyncio.gather(self._reaper, return_exceptions=True)
        await super().close()
