"""EngineServicerBase: what the prefill and decode servicers share (grpc.aio).

The worker lookup (UNAVAILABLE while loading or, for a new request, draining), `Abort`,
`GetState`, `WatchState` and the LoRA adapter calls (services/common/lora.py); each role's
servicer adds its own methods and mixes this in before its generated `*ServiceServicer` base.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from typing import Generic, TypeVar

import grpc

from pdserve.services.common.errors import abort_with
from pdserve.services.common.lora_modules import adapter_from_proto, adapter_to_proto
from pdserve.services.common.server import Phase, ServiceRuntime
from pdserve.services.common.state_feed import HistogramView, StateFrame
from pdserve.services.common.worker import EngineWorker
from pdserve.services.proto import engine_pb2 as pb

logger = logging.getLogger(__name__)
W = TypeVar("W", bound=EngineWorker)


class EngineServicerBase(Generic[W]):
    worker_type: type[EngineWorker] = EngineWorker
    """The role's worker class (PrefillWorker, DecodeWorker)."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime

    def _worker(self, new_request: bool = False) -> W:
        """The worker. Raises ServiceError(UNAVAILABLE) while loading (or draining, for a
        new request)."""
        worker = self.runtime.require_worker(new_request)
        assert isinstance(worker, self.worker_type)
        return worker  # type: ignore[return-value]

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        ids = list(request.request_ids)
        try:
            aborted = await self._worker().abort(ids)
        except Exception as e:
            await abort_with(context, e, ",".join(ids), "Abort")
        for rid in aborted:
            logger.info("[%s] aborted", rid)
        return pb.AbortResponse(aborted_request_ids=aborted)

    async def GetState(self, request: pb.GetStateRequest,
                       context: grpc.aio.ServicerContext) -> pb.EngineState:
        try:
            state = await self._worker().get_state(request.check_invariants)
        except Exception as e:
            await abort_with(context, e, "-", "GetState")
        return pb.EngineState(**state._asdict())

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext) -> pb.LoRAAdapterList:
        name = request.adapter.lora_name
        try:
            worker = self._worker()
            lora = adapter_from_proto(request.adapter)
            await worker.load_lora(lora)
        except Exception as e:
            await abort_with(context, e, name or "-", "LoadLoRAAdapter")
        logger.info("LoRA adapter %s (id %d) loaded from %s", name, lora.lora_int_id,
                    lora.lora_path)
        return self._adapters(worker)

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext
                                ) -> pb.UnloadLoRAAdapterResponse:
        try:
            unloaded = await self._worker().unload_lora(request.lora_name)
        except Exception as e:
            await abort_with(context, e, request.lora_name or "-", "UnloadLoRAAdapter")
        if unloaded:
            logger.info("LoRA adapter %s unloaded", request.lora_name)
        return pb.UnloadLoRAAdapterResponse(unloaded=unloaded)

    async def ListLoRAAdapters(self, request: pb.ListLoRAAdaptersRequest,
                               context: grpc.aio.ServicerContext) -> pb.LoRAAdapterList:
        try:
            worker = self._worker()
        except Exception as e:
            await abort_with(context, e, "-", "ListLoRAAdapters")
        return self._adapters(worker)

    @staticmethod
    def _adapters(worker: EngineWorker) -> pb.LoRAAdapterList:
        return pb.LoRAAdapterList(adapters=[adapter_to_proto(a) for a in worker.lora.listed()])

    async def WatchState(self, request: pb.WatchStateRequest,
                         context: grpc.aio.ServicerContext) -> None:
        # NOTE: a coroutine writing with context.write (see PrefillServicer.FetchKV); the
        # stream ends by itself once the instance drains, so it never holds up a shutdown.
        try:
            worker = self._worker()
            async with aclosing(worker.state_feed.watch(request.interval_s)) as frames:
                async for frame in frames:
                    if self.runtime.phase is not Phase.SERVING:
                        return
                    await context.write(frame_to_proto(frame))
        except Exception as e:
            await abort_with(context, e, "-", "WatchState")


def _histogram(h: HistogramView | None) -> pb.HistogramView | None:
    return None if h is None else pb.HistogramView(bounds=h.bounds, counts=h.counts, sum=h.sum)


def frame_to_proto(f: StateFrame) -> pb.StateFrame:
    c = f.counters
    return pb.StateFrame(
        seq=f.seq, snapshot=f.snapshot, block_states=f.block_states,
        changed_block_ids=f.changed_block_ids, state=pb.EngineState(**f.state._asdict()),
        requests=[pb.RequestView(**r._asdict()) for r in f.requests],
        transfers=[pb.TransferView(**t._asdict()) for t in f.transfers],
        num_preemptions=f.stats.num_preemptions,
        prefix_cache_queries=f.stats.prefix_cache_queries,
        prefix_cache_hits=f.stats.prefix_cache_hits, prompt_tokens=c.prompt_tokens,
        generation_tokens=c.generation_tokens, time=f.time, ttft=_histogram(c.ttft),
        itl=_histogram(c.itl),
        tiers=[pb.TierView(**t._replace(load_seconds=_histogram(t.load_seconds))._asdict())
               for t in c.tiers])
