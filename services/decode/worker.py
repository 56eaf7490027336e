"""DecodeWorker: admit a prefilled request, pull the KV it lacks, decode it in the batch.

    Generate(request, handle)
      │ admission queue (FIFO, bounded): wait until the pool can hold the prompt's blocks
      ▼
    reserve_op (engine thread): prefix-cache hits for the same hashes + fresh blocks,
      │                         allocate_slots(..., delay_cache_blocks=True)
      ▼
    KVFetcher.fetch: only the missing block indices, written into our fresh blocks
      │ ReleaseKV to the prefill instance as soon as the transfer ends, success or not
      │   (a background task, once per handle; the prefill's blocks go back to its cache)
      ▼
    commit_op (engine thread): num_computed_tokens = num_tokens of the handle, cache_blocks
      ▼
    AsyncEngine.generate: the scheduler takes it like any running request (continuous batch)

Without a handle the request goes straight to the engine, which prefills it here
(conditional disaggregation; also failover: prompt + tokens generated so far recomputed).
Whatever happens, the request's blocks end up freed: by the scheduler when it finishes or
is aborted, by `free_unscheduled_op` (shielded) on every other way out. A request that never
reaches the transfer (aborted or failing while queued for blocks) sends its ReleaseKV on the
way out; the prefill's TTL unpins what a dead decode instance never released. States and
block owners: docs/lifecycle.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import NamedTuple

import grpc

from services.common.errors import ServiceError
from services.common.state_feed import TransferView
from services.common.worker import EngineWorker, free_unscheduled_op
from services.decode.kv_fetcher import KVFetcher
from shared.engine.engine_core import EngineCore
from shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens
from shared.kv_transfer.handle import KVHandle
from shared.request import FinishReason, Request, TokenLogprobs
from shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_ADMISSION_POLL_S = 0.05


class GenerateOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None
    num_cached_tokens: int | None
    """On the first output: the prefix-cache hit on this instance, in tokens."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On the first output of a local prefill asking for them: one per prompt token."""


@dataclass(slots=True)
class _Ticket:
    request: Request
    handle: KVHandle | None = None
    aborted: bool = False
    released: bool = False
    """ReleaseKV for `handle` was sent (or is being sent): never send it twice."""
    task: asyncio.Task | None = None
    """Admission + KV transfer, cancelled by Abort."""
    paused: bool = False
    """Paused by SetPaused (its client reads too slowly)."""
    paused_since_token: bool = False
    """Paused since its last token: the next gap is the client's, not an inter-token
    latency (not observed)."""


def reserve_op(engine: EngineCore, request: Request, num_tokens: int,
               watermark: int) -> tuple[int, list[int]] | None:
    """Hold blocks for the first `num_tokens` tokens: cached hits first, fresh blocks after.

    Returns (prefix-hit tokens, the request's block ids), or None when the pool cannot
    hold them now (with `watermark` blocks to spare while other requests run), even after
    freeing the blocks of paused requests (`Scheduler.preempt_paused`: recomputed on resume).
    """
    kv = engine.kv_cache_manager
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    num_computed = max(num_tokens, num_hit_tokens)
    num_new_blocks = -(-num_computed // kv.block_size) - len(hits)
    spare = watermark if engine.scheduler.has_unfinished_requests() else 0
    while kv.num_free_blocks - num_new_blocks - sum(1 for b in hits if b.ref_cnt == 0) < spare:
        if not engine.scheduler.preempt_paused():
            return None
    if kv.allocate_slots(request, num_computed - num_hit_tokens, hits, num_hit_tokens,
                         delay_cache_blocks=True) is None:
        return None
    return num_hit_tokens, kv.get_block_ids(request.request_id)


def commit_op(engine: EngineCore, request: Request, num_computed_tokens: int) -> None:
    """The transferred KV is in place: mark it computed and make its full blocks cached."""
    request.num_computed_tokens = num_computed_tokens
    engine.kv_cache_manager.cache_blocks(request, num_computed_tokens)


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fetcher = KVFetcher(self.engine_core.model_runner.kv_caches, self.config,
                                 self.metrics)
        self.watermark_blocks = max(1, self.num_gpu_blocks // 100)
        self._tickets: dict[str, _Ticket] = {}
        self._admission: deque[_Ticket] = deque()
        self._admission_event = asyncio.Event()
        self._blocks_in_flight: dict[bytes, asyncio.Future] = {}
        """block_hash -> done when the transfer that fetches that block here has committed
        (or failed): a request with the same prefix waits for it and reuses the blocks."""

    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     output_token_ids: list[int], params: SamplingParams,
                     cache_salt: str | None) -> Request:
        """Build and validate (`EngineCore.validate_request`, before any block is held or
        any KV fetched). Raises ValueError naming the field."""
        request = Request(request_id, list(prompt_token_ids), params,
                          eos_token_id=self.eos_token_id, cache_salt=cache_salt,
                          output_token_ids=list(output_token_ids))
        self.engine_core.validate_request(request)
        if params.structured_outputs is not None:  # compiles while the KV arrives
            self.engine_core.structured_output.grammar(params.structured_outputs)
        return request

    def check_handle(self, request: Request, handle: KVHandle) -> None:
        """Does `handle` describe this request's prompt, in a layout we can take? ValueError
        naming the field if not; ServiceError(FAILED_PRECONDITION) for KV computed under
        another weight quantization (never mixed: other weights give other KV)."""
        if (handle.quantization or "none") != self.quantization:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"kv_transfer_params.quantization: the prefill instance runs "
                               f"quantization {handle.quantization or 'none'!r}, this decode "
                               f"instance runs {self.quantization!r}; KV computed by other "
                               "weights cannot be used (run prefill and decode with the same "
                               "--quantization)")
        if handle.layout != self.layout:
            raise ValueError(f"kv_transfer_params: KV layout {tuple(handle.layout)} does not "
                             f"match this instance's {tuple(self.layout)}")
        if handle.model != self.model_name:
            raise ValueError(f"kv_transfer_params.model is {handle.model!r}, this instance "
                             f"serves {self.model_name!r}")
        if not handle.prefill_address:
            raise ValueError("kv_transfer_params.prefill_address is empty")
        num_tokens, bs = handle.num_tokens, self.block_size
        if not 0 < num_tokens < request.num_tokens:
            raise ValueError(f"kv_transfer_params.num_tokens={num_tokens} must be in "
                             f"[1, {request.num_tokens - 1}]")
        if len(handle.block_ids) != -(-num_tokens // bs):
            raise ValueError(f"kv_transfer_params.block_ids has {len(handle.block_ids)} blocks, "
                             f"{num_tokens} tokens need {-(-num_tokens // bs)}")
        expected = hash_request_tokens(request.token_slice(0, num_tokens), bs,
                                       block_extra_keys(self.model_name, request.cache_salt,
                                                        self.quantization))
        if list(handle.block_hashes) != expected:
            i = next((i for i, (a, b) in enumerate(zip(handle.block_hashes, expected)) if a != b),
                     min(len(handle.block_hashes), len(expected)))
            raise ValueError(f"kv_transfer_params.block_hashes: block {i} does not match the "
                             "prompt (another prompt, model or cache_salt)")
        request.block_hashes = expected  # verified: the KV cache manager hashes no more

    async def generate(self, request: Request,
                       handle: KVHandle | None) -> AsyncIterator[GenerateOutput]:
        """Decode `request` (transferring its prompt's KV first when `handle` is given).

        Raises (before the first output):
            ValueError: a bad handle. ServiceError: ALREADY_EXISTS, RESOURCE_EXHAUSTED (the
            waiting queue is full), or the transfer's status (NOT_FOUND, DATA_LOSS, ...).
        """
        request_id = request.request_id
        if request_id in self._tickets:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request {request_id!r} is already being decoded")
        if handle is not None:
            self.check_handle(request, handle)
        if self.num_pending() + self.engine_core.scheduler.num_waiting \
                >= self.config.max_waiting_requests:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"decode waiting queue is full ({self.config.max_waiting_requests}"
                               " requests); retry later or elsewhere")
        ticket = self._tickets[request_id] = _Ticket(request, handle)
        try:
            num_cached = None
            if handle is not None:
                ticket.task = asyncio.get_running_loop().create_task(
                    self._admit_transferred(ticket, handle))
                try:
                    num_cached = await ticket.task
                except asyncio.CancelledError:
                    if (task := asyncio.current_task()) is not None and task.cancelling():
                        raise  # our caller is cancelled, not just the transfer
                    if not ticket.aborted:
                        raise ServiceError(grpc.StatusCode.ABORTED,
                                           f"KV transfer of {request_id!r} was cancelled"
                                           ) from None
            if ticket.aborted:
                yield GenerateOutput([], [], FinishReason.ABORT, num_cached)
                return
            async with aclosing(self._decode(ticket, num_cached, handle is None)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            try:
                await asyncio.shield(self.engine.call(lambda e: free_unscheduled_op(e, request)))
            finally:
                self._tickets.pop(request_id, None)
                self._notify_admission()
                self._release(ticket)  # a no-op unless the transfer never ran

    async def _decode(self, ticket: _Ticket, num_cached: int | None,
                      local: bool) -> AsyncIterator[GenerateOutput]:
        request = ticket.request
        arrival = last = time.monotonic()
        num_generated = 0
        async with aclosing(self.engine.generate(request)) as deltas:
            async for delta in deltas:
                now = time.monotonic()
                if ticket.aborted and not delta.finished:
                    yield GenerateOutput([], [], FinishReason.ABORT, None)
                    return
                first = num_generated == 0
                if first and local:
                    num_cached = max(request.num_cached_tokens, 0)
                    self.metrics.first_token(now - arrival)
                elif not first and not ticket.paused_since_token:
                    self.metrics.inter_token(now - last)
                ticket.paused_since_token = ticket.paused
                last = now
                num_generated += len(delta.new_token_ids)
                if delta.finished:
                    self._notify_admission()
                    self.metrics.request_finished(
                        delta.finish_reason.value, request.num_prompt_tokens if local else 0,
                        num_generated, now - arrival)
                yield GenerateOutput(delta.new_token_ids, delta.new_logprobs,
                                     delta.finish_reason, num_cached if first else None,
                                     delta.prompt_logprobs)

    async def _admit_transferred(self, ticket: _Ticket, handle: KVHandle) -> int:
        """Reserve blocks, fetch the missing ones, commit. Returns the prefix-hit tokens."""
        request = ticket.request
        await self._wait_for_shared_blocks(handle)
        # NOTE: claimed with no await since the wait above, so two requests on one prefix
        # can never both find it unclaimed (some claimed blocks may turn out to be cached
        # here already; a request waiting on them then just waits for our commit).
        done = asyncio.get_running_loop().create_future()
        mine = [h for h in handle.block_hashes if h not in self._blocks_in_flight]
        for block_hash in mine:
            self._blocks_in_flight[block_hash] = done
        try:
            num_hit_tokens, block_ids = await self._reserve(ticket, handle.num_tokens)
            first_missing = num_hit_tokens // self.block_size
            missing = list(range(first_missing, len(handle.block_ids)))
            try:
                if missing:
                    await self.fetcher.fetch(request.request_id, handle, missing,
                                             [block_ids[i] for i in missing])
            finally:
                # Our blocks hold the KV now (or the transfer failed): the prefill's pin has
                # served its purpose, whatever the decode does next.
                self._release(ticket)
            num_computed = max(handle.num_tokens, num_hit_tokens)
            await self.engine.call(lambda e: commit_op(e, request, num_computed))
        finally:
            for block_hash in mine:
                if self._blocks_in_flight.get(block_hash) is done:
                    del self._blocks_in_flight[block_hash]
            done.set_result(None)
        logger.debug("[%s] KV in place: %d blocks reused, %d fetched from %s",
                     request.request_id, first_missing, len(missing), handle.prefill_address)
        return num_hit_tokens

    async def _wait_for_shared_blocks(self, handle: KVHandle) -> None:
        """Wait until no transfer in flight here is fetching a prefix block of `handle`.

        Requests sharing a prefix arrive together (a burst on one system prompt): without
        this, each would fetch the whole shared prefix, since fetched blocks join the prefix
        cache only when their transfer commits. Waiting lets the first transfer commit and
        the others hit its blocks. Bounded by the fetch timeout of the transfer waited for;
        if that transfer fails, this one fetches the blocks itself.
        """
        while True:
            pending = {self._blocks_in_flight[h] for h in handle.block_hashes
                       if h in self._blocks_in_flight}
            if not pending:
                return
            await asyncio.wait(pending)

    def _release(self, ticket: _Ticket) -> None:
        """ReleaseKV for the ticket's handle, as a tracked background task (`close` awaits
        or cancels it); once per ticket, later calls and tickets without a handle are no-ops.
        """
        if ticket.handle is None or ticket.released:
            return
        ticket.released = True
        self.spawn(self.fetcher.release(ticket.request.request_id, ticket.handle))

    async def _reserve(self, ticket: _Ticket, num_tokens: int) -> tuple[int, list[int]]:
        """Wait (FIFO) until the pool can hold the request's first `num_tokens` tokens."""
        self._admission.append(ticket)
        try:
            while True:
                event = self._admission_event
                if self._admission[0] is ticket:
                    got = await self.engine.call(
                        lambda e: reserve_op(e, ticket.request, num_tokens,
                                             self.watermark_blocks))
                    if got is not None:
                        return got
                try:
                    await asyncio.wait_for(event.wait(), _ADMISSION_POLL_S)
                except TimeoutError:
                    pass
        finally:
            self._admission.remove(ticket)
            self._notify_admission()

    def _notify_admission(self) -> None:
        """Wake the admission queue (blocks were freed, or its head changed)."""
        self._admission_event.set()
        self._admission_event = asyncio.Event()

    async def abort(self, request_ids: list[str]) -> list[str]:
        aborted = set()
        for request_id in request_ids:
            ticket = self._tickets.get(request_id)
            if ticket is not None:
                ticket.aborted = True
                aborted.add(request_id)
                if ticket.task is not None and not ticket.task.done():
                    ticket.task.cancel()
        aborted.update(self.engine.request_abort(request_ids))
        return sorted(aborted)

    async def set_paused(self, request_ids: list[str], paused: bool) -> list[str]:
        """Pause or resume requests in the engine (`AsyncEngine.set_paused`); returns the ids
        it holds. A request still queued for blocks or in its KV transfer is not there yet:
        ignored (the gateway asks again while its client stays behind)."""
        held = await self.engine.set_paused(request_ids, paused)
        for request_id in held:
            if (ticket := self._tickets.get(request_id)) is not None:
                ticket.paused = paused
                ticket.paused_since_token = ticket.paused_since_token or paused
        return held

    def num_pending(self) -> int:
        return len(self._admission)

    def num_in_flight(self) -> int:
        return len(self._tickets)

    def owned_request_ids(self) -> set[str]:
        return set(self._tickets)

    def request_labels(self) -> dict[str, tuple[str, Request | None]]:
        # Blocks held outside the scheduler: reserved for a transfer, not yet committed.
        return {rid: ("transfer", t.request) for rid, t in self._tickets.items()}

    def transfers(self) -> list[TransferView]:
        now = time.monotonic()
        return [TransferView(rid, "receive", address, num_blocks, now - start)
                for rid, (address, num_blocks, start) in self.fetcher.in_flight.items()]

    async def close(self) -> None:
        await super().close()
        await self.fetcher.close()
