"""DecodeServicer: proto <-> DecodeWorker, nothing else (grpc.aio)."""

from __future__ import annotations

import logging
from contextlib import aclosing

import grpc

from pdserve.services.common.convert import (
    FINISH_REASONS,
    handle_from_proto,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
)
from pdserve.services.common.errors import abort_with
from pdserve.services.common.kv_peer_servicer import add_kv_peer_servicer
from pdserve.services.common.server import ServiceRuntime
from pdserve.services.common.servicer import EngineServicerBase
from pdserve.services.decode.worker import DecodeWorker, PeerHint
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeServicer(EngineServicerBase[DecodeWorker], engine_pb2_grpc.DecodeServiceServicer):
    worker_type = DecodeWorker

    async def Generate(self, request: pb.DecodeRequest,
                       context: grpc.aio.ServicerContext) -> None:
        # NOTE: a coroutine writing with context.write (see PrefillServicer.FetchKV): a
        # cancelled call frees the request's blocks at once.
        rid = request.request_id
        num_tokens = 0
        try:
            worker = self._worker(new_request=True)
            if not rid:
                raise ValueError("request_id must not be empty")
            params = sampling_params_from_proto(request.sampling_params)
            lora = worker.lora.resolve(request.lora_request
                                       if request.HasField("lora_request") else None)
            engine_request = worker.make_request(
                rid, list(request.prompt_token_ids), list(request.output_token_ids), params,
                request.cache_salt or None, lora)
            handle = (handle_from_proto(request.kv_transfer_params)
                      if request.HasField("kv_transfer_params") else None)
            peer = (PeerHint(request.peer_kv.address, request.peer_kv.num_blocks)
                    if request.HasField("peer_kv") and handle is None else None)
            async with aclosing(worker.generate(engine_request, handle, peer)) as outputs:
                async for out in outputs:
                    chunk = pb.TokenChunk(
                        request_id=rid, token_ids=out.new_token_ids,
                        logprobs=[logprobs_to_proto(lp) for lp in out.new_logprobs],
                        finish_reason=FINISH_REASONS[out.finish_reason],
                        stop_reason=out.stop_reason)
                    if num_tokens == 0:  # the first chunk says the prefix-cache hit
                        chunk.num_cached_tokens = out.num_cached_tokens
                    num_tokens += len(out.new_token_ids)
                    chunk.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
                    await context.write(chunk)
                    if out.finish_reason is not None:
                        logger.info("[%s] decoded %d tokens, finished: %s", rid, num_tokens,
                                    out.finish_reason.value)
        except Exception as e:
            await abort_with(context, e, rid, "Generate")

    async def SetPaused(self, request: pb.SetPausedRequest,
                        context: grpc.aio.ServicerContext) -> pb.SetPausedResponse:
        ids = list(request.request_ids)
        try:
            known = await self._worker().set_paused(ids, request.paused)
        except Exception as e:
            await abort_with(context, e, ",".join(ids), "SetPaused")
        if known:
            logger.debug("%s %s", "paused" if request.paused else "resumed", ",".join(known))
        return pb.SetPausedResponse(request_ids=known)


def add_decode_servicer(server: grpc.aio.Server, runtime: ServiceRuntime) -> None:
    engine_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(runtime), server)
    add_kv_peer_servicer(server, runtime)
