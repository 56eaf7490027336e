"""DecodeWorker: decode a request in the batch, pulling the KV it lacks first.

    Generate(request, handle)
      │ make_request: EngineCore.validate_request, block hashes
      ▼
    a prefill's handle: KVReceiving.start_receive (services/common/kv_receiving.py): the
      │ request waits while the missing blocks are fetched, then is scheduled
    no handle: the engine prefills it here (conditional disaggregation; also failover:
      │ prompt + tokens generated so far recomputed), with a peer's prefix first when
      │ the placement names one (`PeerHint`, the peer tier: docs/kv-tiers.md)
      ▼
    scheduled like any request (continuous batch)

The decode instance also holds KV for its peers (`KVHolding`: PinKV, FetchKV, ReleaseKV).
The scheduler owns the request's blocks from the moment it is added: it frees them when the
request finishes or is aborted (after the receive writing them ends). A failed transfer of
a prefill's KV aborts the engine request; Generate raises the transfer's status. States and
block owners: docs/lifecycle.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from pdserve.services.common.errors import ServiceError
from pdserve.services.common.kv_receiving import KVReceiving, PeerHint, Receive
from pdserve.shared.engine.scheduler_output import EngineCoreOutput
from pdserve.shared.kv_transfer.params import KVHandle
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.request import FinishReason, Request
from pdserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream(Receive):
    """A Generate call's service state (the request and its blocks are the scheduler's)."""

    aborted: bool = False
    paused: bool = False
    """Paused by SetPaused (its client reads too slowly)."""
    paused_since_token: bool = False
    """Paused since its last token: the next gap is the client's, not an inter-token
    latency (not observed)."""


class DecodeWorker(KVReceiving):
    role = "decode"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._streams: dict[str, _Stream] = {}
        self._num_waiting = 0
        """Generate calls with no output yet (bounded by max_waiting_requests)."""

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
                    stream.handle = await self.pin_peer(request, peer)
                async with aclosing(self._decode(stream)) as outputs:
                    async for output in outputs:
                        yield output
            finally:
                if stream.transfer is not None and not stream.transfer.done():
                    stream.transfer.cancel()
                    await asyncio.gather(stream.transfer, return_exceptions=True)
                self._streams.pop(request_id, None)
                self.release_handle(stream)  # a no-op unless the transfer never ran

    async def _decode(self, stream: _Stream) -> AsyncIterator[EngineCoreOutput]:
        request, handle = stream.request, stream.handle
        local_prompt = handle is None or handle.peer
        arrival = last = time.monotonic()
        num_generated = 0
        waiting = True
        self._num_waiting += 1  # NOTE: here, with its try: a body never started adds none
        try:
            if handle is not None:
                stream.transfer = await self.start_receive(stream, handle)
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

