"""DecodeWorker: decode a prefilled request in the batch, pulling the KV it lacks first.

    Generate(request, handle)
      │ make_request: EngineCore.validate_request, block hashes; check_handle (verified)
      ▼
    engine request, kv_transfer_params=RemotePrefill(num_tokens=N):
      │ WAITING_FOR_REMOTE_KVS in the scheduler, which allocates its blocks in its own
      │ admission order (prefix-cache hits + fresh blocks, not cached yet)
      ▼
    KVFetcher.fetch (this loop, told the block ids by the connector): only the missing
      │ blocks; ReleaseKV to the prefill as soon as the transfer ends, success or not
      ▼
    connector.recv_finished ──▶ Scheduler.update_from_kv_xfer_finished (engine op):
      │ num_computed_tokens = N, blocks cached, WAITING
      ▼
    scheduled like any request (continuous batch)

Without a handle the request goes straight to the engine, which prefills it here
(conditional disaggregation; also failover: prompt + tokens generated so far recomputed).
With a peer hint instead (`PeerHint`, the peer tier: docs/kv-tiers.md) the prefix a peer
holds is pinned there (PinKV) and fetched like a prefill's KV; the rest is computed here.
A peer that cannot pin, or fails mid-fetch, costs a recompute here, never the request.

The decode instance also holds KV for its peers (`KVHolding`: PinKV, FetchKV, ReleaseKV).
The scheduler owns the request's blocks from the moment it is added: it frees them when the
request finishes or is aborted (after the receive writing them ends). A failed transfer
aborts the engine request; Generate raises the transfer's status. States and block owners:
docs/lifecycle.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import NamedTuple

import grpc

from pdserve.services.common.errors import ServiceError
from pdserve.services.common.kv_holding import KVHolding
from pdserve.services.common.lora import check_kv_adapter
from pdserve.services.common.lora_modules import adapter_to_proto
from pdserve.services.common.state_feed import TransferView
from pdserve.services.decode.kv_fetcher import KVFetcher
from pdserve.shared.engine.scheduler_output import EngineCoreOutput
from pdserve.shared.kv_transfer.params import KVHandle, RemotePrefill
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.request import FinishReason, Request
from pdserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PeerHint(NamedTuple):
    """A peer that holds the prompt's first `num_blocks` full blocks (the gateway's
    placement, from the prefix index)."""

    address: str
    num_blocks: int


@dataclass(slots=True)
class _Stream:
    """A Generate call's service state (the request and its blocks are the scheduler's)."""

    request: Request
    handle: KVHandle | None = None
    aborted: bool = False
    transfer: asyncio.Task | None = None
    """Receive of the handle's KV, cancelled by Abort."""
    released: bool = False
    """ReleaseKV for `handle` was sent (or is being sent): never send it twice."""
    paused: bool = False
    """Paused by SetPaused (its client reads too slowly)."""
    paused_since_token: bool = False
    """Paused since its last token: the next gap is the client's, not an inter-token
    latency (not observed)."""


class DecodeWorker(KVHolding):
    role = "decode"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fetcher = KVFetcher(self.engine_core.model_runner.kv_caches, self.config,
                                 self.metrics, self.engine.tracer)
        self._streams: dict[str, _Stream] = {}
        self._num_waiting = 0
        """Generate calls with no output yet (bounded by max_waiting_requests)."""
        self._blocks_in_flight: dict[bytes, asyncio.Future] = {}
        """block_hash -> done when the transfer that fetches that block here has committed
        (or failed): a request with the same prefix waits for it and reuses the blocks."""

    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     output_token_ids: list[int], params: SamplingParams,
                     cache_salt: str | None,
                     lora_request: LoRARequest | None = None) -> Request:
        """Build and validate (`EngineCore.validate_request`, before any block is held or
        any KV fetched). Raises ValueError naming the field."""
        request = Request(request_id, list(prompt_token_ids), params,
                          eos_token_id=self.eos_token_id, cache_salt=cache_salt,
                          output_token_ids=list(output_token_ids),
                          lora_request=lora_request,
                          block_hasher=self.engine_core.kv_cache_manager.block_hasher)
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
        check_kv_adapter(handle.lora_name, handle.lora_int_id, request.lora_request)
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
        if len(handle.block_hashes) != num_tokens // bs:
            raise ValueError(f"kv_transfer_params.block_hashes has {len(handle.block_hashes)} "
                             f"hashes, {num_tokens} tokens fill {num_tokens // bs} blocks")
        # NOTE: longrope: the prefill instance computed a prompt longer than the original
        # length with the long factors (shared/engine/longrope.py), and hashed it so.
        original = self.engine_core.scheduler.longrope_original
        if original is not None and num_tokens > original and not request.rope_long:
            request.set_rope_long()
        # NOTE: the request hashed its blocks when it was made (once: docs/lifecycle.md).
        expected = request.block_hashes[:num_tokens // bs]
        if list(handle.block_hashes) != expected:
            i = next((i for i, (a, b) in enumerate(zip(handle.block_hashes, expected)) if a != b),
                     min(len(handle.block_hashes), len(expected)))
            raise ValueError(f"kv_transfer_params.block_hashes: block {i} does not match the "
                             "prompt (another prompt, model or cache_salt)")

    async def generate(self, request: Request, handle: KVHandle | None,
                       peer: PeerHint | None = None) -> AsyncIterator[EngineCoreOutput]:
        """Decode `request` (transferring its prompt's KV first when `handle` is given, or
        the prefix `peer` holds when no handle is).

        Raises (before the first output):
            ValueError: a bad handle. ServiceError: ALREADY_EXISTS, RESOURCE_EXHAUSTED (the
            waiting queue is full), or the transfer's status (NOT_FOUND, DATA_LOSS, ...).
        """
        request_id = request.request_id
        with self.active(request_id, "is already being decoded"):
            if handle is not None:
                self.check_handle(request, handle)
            if self._num_waiting >= self.config.max_waiting_requests:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"decode waiting queue is full "
                                   f"({self.config.max_waiting_requests} requests); retry "
                                   "later or elsewhere")
            stream = self._streams[request_id] = _Stream(request, handle)
            try:
                if handle is None and peer is not None:
                    stream.handle = await self._pin_peer(request, peer)
                async with aclosing(self._decode(stream)) as outputs:
                    async for output in outputs:
                        yield output
            finally:
                if stream.transfer is not None and not stream.transfer.done():
                    stream.transfer.cancel()
                    await asyncio.gather(stream.transfer, return_exceptions=True)
                self._streams.pop(request_id, None)
                self._release(stream)  # a no-op unless the transfer never ran

    async def _decode(self, stream: _Stream) -> AsyncIterator[EngineCoreOutput]:
        request, handle = stream.request, stream.handle
        local_prompt = handle is None or handle.peer
        arrival = last = time.monotonic()
        num_generated = 0
        waiting = True
        self._num_waiting += 1  # NOTE: here, with its try: a body never started adds none
        try:
            if handle is not None:
                stream.transfer = await self._start_transfer(stream, handle)
            async with aclosing(self.engine.generate(request, validated=True)) as deltas:
                async for delta in deltas:
                    now = time.monotonic()
                    transfer = stream.transfer
                    if delta.finish_reason == FinishReason.ABORT and transfer is not None \
                            and transfer.done() and not transfer.cancelled() \
                            and transfer.exception() is not None:
                        raise transfer.exception()  # type: ignore[misc]
                    if stream.aborted and not delta.finished:
                        yield EngineCoreOutput(request.request_id, [], [], FinishReason.ABORT,
                                               None, num_cached_tokens=delta.num_cached_tokens)
                        return
                    if num_generated == 0:
                        waiting = False
                        self._num_waiting -= 1
                        if local_prompt:
                            self.metrics.first_token(now - arrival)
                    elif not stream.paused_since_token:
                        self.metrics.inter_token(now - last)
                    stream.paused_since_token = stream.paused
                    last = now
                    num_generated += len(delta.new_token_ids)
                    if delta.finished:
                        self.metrics.request_finished(
                            delta.finish_reason.value,
                            request.num_prompt_tokens if local_prompt else 0,
                            num_generated, now - arrival)
                    yield delta
        finally:
            if waiting:
                self._num_waiting -= 1

    async def _start_transfer(self, stream: _Stream, handle: KVHandle) -> asyncio.Task:
        """Wait out transfers of the same prefix, claim its blocks, and start the receive
        task (it waits for the scheduler to allocate the request's blocks)."""
        request = stream.request
        await self._wait_for_shared_blocks(handle)
        # NOTE: claimed with no await since the wait above, so two requests on one prefix
        # can never both find it unclaimed (some claimed blocks may turn out to be cached
        # here already; a request waiting on them then just waits for our commit).
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        mine = [h for h in handle.block_hashes if h not in self._blocks_in_flight]
        for block_hash in mine:
            self._blocks_in_flight[block_hash] = done
        allocated = loop.create_future()
        self.kv_connector.expect_recv(
            request.request_id,
            lambda ids, hit: loop.call_soon_threadsafe(_set_result, allocated, (ids, hit)))
        request.kv_transfer_params = RemotePrefill(handle.num_tokens,
                                                   recompute_on_failure=handle.peer)
        transfer = loop.create_task(self._receive(stream, handle, allocated))

        def on_done(task: asyncio.Task) -> None:
            for block_hash in mine:
                if self._blocks_in_flight.get(block_hash) is done:
                    del self._blocks_in_flight[block_hash]
            done.set_result(None)
            failed = task.cancelled() or task.exception() is not None
            if failed and not (handle.peer and not task.cancelled()):
                self.engine.request_abort([request.request_id])  # its ABORT ends the stream
            # NOTE: a peer's failed fetch is recomputed here (the scheduler's
            # recompute_on_failure): not the request's failure.

        transfer.add_done_callback(on_done)
        return transfer

    async def _receive(self, stream: _Stream, handle: KVHandle,
                       allocated: asyncio.Future) -> None:
        """Fetch the missing blocks into those the scheduler allocated, tell the connector,
        and wait for the scheduler to take the KV in."""
        request_id = stream.request.request_id
        ok = False
        try:
            block_ids, num_hit_tokens = await allocated
            first_missing = num_hit_tokens // self.block_size
            # NOTE: blocks before a sliding window are the null block here: not fetched.
            missing = [i for i in range(first_missing, handle.num_blocks) if block_ids[i]]
            try:
                if missing:
                    await self.fetcher.fetch(request_id, handle.prefill_address, missing,
                                             [block_ids[i] for i in missing], handle.peer)
                ok = True
            except ServiceError as e:
                if not handle.peer:
                    raise
                logger.warning("[%s] fetch from peer %s failed (%s): computing the prompt "
                               "here", request_id, handle.prefill_address, e)
                self.metrics.tier_metrics().peer_fetched(len(missing), 0, "fetch")
            else:
                if handle.peer:
                    self.metrics.tier_metrics().peer_fetched(len(missing), len(missing))
            finally:
                # Our blocks hold the KV now (or the transfer failed): the prefill's pin has
                # served its purpose, whatever the decode does next.
                self._release(stream)
        finally:
            self.kv_connector.recv_finished(request_id, ok)
            taken = self.engine.submit(lambda e: e.scheduler.update_from_kv_xfer_finished())
        await taken
        logger.debug("[%s] KV in place: %d blocks reused, %d fetched from %s", request_id,
                     first_missing, len(missing), handle.prefill_address)

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

    def _release(self, stream: _Stream) -> None:
        """ReleaseKV for the stream's handle, as a tracked background task (`close` awaits
        or cancels it); once per stream, later calls and streams without a handle are
        no-ops."""
        if stream.handle is None or stream.released:
            return
        stream.released = True
        self.spawn(self.fetcher.release(stream.request.request_id, stream.handle.prefill_address,
                                        stream.handle.peer))

    async def _pin_peer(self, request: Request, peer: PeerHint) -> KVHandle | None:
        """PinKV at `peer` for the prompt's first k full blocks (k: the hint's, leaving at
        least two prompt tokens to compute here), checked as a prefill's handle; None
        (the prompt is computed here) when the peer cannot, logged and counted."""
        bs = self.block_size
        k = min(peer.num_blocks, (request.num_prompt_tokens - 2) // bs)
        if k <= 0 or peer.address == self.identity.address:
            return None
        lora = request.lora_request
        try:
            handle = await self.fetcher.pin(
                request.request_id, peer.address, request.prompt_token_ids[:k * bs + 1],
                request.cache_salt, None if lora is None else adapter_to_proto(lora))
        except ServiceError as e:
            logger.warning("[%s] %s: computing the prompt here", request.request_id, e)
            self.metrics.tier_metrics().peer_fetched(k, 0, "pin")
            return None
        try:
            self.check_handle(request, handle)
        except (ValueError, ServiceError) as e:
            logger.warning("[%s] peer %s pinned KV this instance cannot take (%s): computing "
                           "the prompt here", request.request_id, peer.address, e)
            self.metrics.tier_metrics().peer_fetched(k, 0, "pin")
            self.spawn(self.fetcher.release(request.request_id, peer.address, True))
            return None
        return handle

    async def abort(self, request_ids: list[str]) -> list[str]:
        aborted = {r for r in request_ids if r in self._streams}
        for request_id in aborted:
            self._streams[request_id].aborted = True
        aborted.update(self.engine.request_abort(request_ids))
        aborted.update(self.close_held(request_ids))
        return sorted(aborted)

    async def set_paused(self, request_ids: list[str], paused: bool) -> list[str]:
        """Pause or resume requests in the engine (`AsyncEngine.set_paused`); returns the ids
        it holds. A request still waiting for its KV is not scheduled yet: ignored (the
        gateway asks again while its client stays behind)."""
        held = await self.engine.set_paused(request_ids, paused)
        for request_id in held:
            if (stream := self._streams.get(request_id)) is not None:
                stream.paused = paused
                stream.paused_since_token = stream.paused_since_token or paused
        return held

    def transfers(self) -> list[TransferView]:
        now = time.monotonic()
        return super().transfers() + [
            TransferView(rid, "receive", address, num_blocks, now - start)
            for rid, (address, num_blocks, start) in self.fetcher.in_flight.items()]

    async def close(self) -> None:
        await super().close()
        await self.fetcher.close()


def _set_result(fut: asyncio.Future, result: object) -> None:
    if not fut.done():
        fut.set_result(result)
