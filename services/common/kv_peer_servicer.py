"""KV holding RPCs over a `KVHolding` worker: FetchKV and ReleaseKV (PrefillService and
KVPeerService), PinKV (KVPeerService, the peer tier). Proto <-> worker, nothing else."""

from __future__ import annotations

import logging
from contextlib import aclosing

import grpc

from pdserve.services.common.convert import handle_to_proto
from pdserve.services.common.errors import abort_with
from pdserve.services.common.kv_holding import KVHolding
from pdserve.services.common.server import ServiceRuntime
from pdserve.services.common.servicer import EngineServicerBase
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from pdserve.shared.kv_transfer.codec import KVChunkData

logger = logging.getLogger(__name__)


class KVHoldingRPCs(EngineServicerBase[KVHolding]):
    """FetchKV and ReleaseKV of held KV (a prefill's for its decode, a pin for a peer)."""

    worker_type = KVHolding

    async def FetchKV(self, request: pb.FetchKVRequest,
                      context: grpc.aio.ServicerContext) -> None:
        # NOTE: a coroutine writing with context.write, not an async generator: when the
        # client cancels, CancelledError lands in this frame and `aclosing` ends the stream
        # (and its pin bookkeeping) at once, instead of whenever the generator is collected.
        rid = request.request_id

        def encode(c: KVChunkData) -> pb.KVChunk:  # runs in the worker's gather thread
            return pb.KVChunk(request_id=rid, block_indices=c.block_indices, dtype=c.dtype,
                              shape=c.shape, data=c.data, layer_start=c.layer_start)

        try:
            worker = self._worker()
            async with aclosing(worker.fetch_kv(rid, list(request.block_indices),
                                                encode)) as messages:
                async for message in messages:
                    await context.write(message)
        except Exception as e:
            await abort_with(context, e, rid, "FetchKV")

    async def ReleaseKV(self, request: pb.ReleaseKVRequest,
                        context: grpc.aio.ServicerContext) -> pb.ReleaseKVResponse:
        try:
            released = await self._worker().release(request.request_id)
        except Exception as e:
            await abort_with(context, e, request.request_id, "ReleaseKV")
        logger.debug("[%s] ReleaseKV: released=%s", request.request_id, released)
        return pb.ReleaseKVResponse(released=released)


class KVPeerServicer(KVHoldingRPCs, engine_pb2_grpc.KVPeerServiceServicer):
    """KVPeerService: PinKV, FetchKV, ReleaseKV; on every engine instance."""

    async def PinKV(self, request: pb.PinKVRequest,
                    context: grpc.aio.ServicerContext) -> pb.PinKVResponse:
        rid = request.request_id
        try:
            worker = self._worker(new_request=True)
            if not rid:
                raise ValueError("request_id must not be empty")
            lora = worker.lora.resolve(request.lora_request
                                       if request.HasField("lora_request") else None)
            handle = await worker.pin(rid, list(request.prompt_token_ids),
                                      request.cache_salt or None, lora)
        except Exception as e:
            await abort_with(context, e, rid, "PinKV")
        logger.debug("[%s] pinned %d blocks for a peer", rid, len(handle.block_hashes))
        return pb.PinKVResponse(kv_transfer_params=handle_to_proto(handle))


def add_kv_peer_servicer(server: grpc.aio.Server, runtime: ServiceRuntime) -> None:
    engine_pb2_grpc.add_KVPeerServiceServicer_to_server(KVPeerServicer(runtime), server)
