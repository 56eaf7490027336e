"""PrefillServicer: proto <-> PrefillWorker, nothing else (grpc.aio)."""

from __future__ import annotations

import logging

import grpc

from pdserve.services.common.convert import (
    FINISH_REASONS,
    handle_to_proto,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
)
from pdserve.services.common.errors import abort_with
from pdserve.services.common.kv_peer_servicer import KVHoldingRPCs, add_kv_peer_servicer
from pdserve.services.common.kv_receiving import PeerHint
from pdserve.services.common.server import ServiceRuntime
from pdserve.services.prefill.pooling import pool
from pdserve.services.prefill.worker import PrefillWorker
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillServicer(KVHoldingRPCs, engine_pb2_grpc.PrefillServiceServicer):
    worker_type = PrefillWorker

    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        rid = request.request_id
        try:
            worker = self._worker(new_request=True)
            if not rid:
                raise ValueError("request_id must not be empty")
            params = sampling_params_from_proto(request.sampling_params)
            lora = worker.lora.resolve(request.lora_request
                                       if request.HasField("lora_request") else None)
            peer = (PeerHint(request.peer_kv.address, request.peer_kv.num_blocks)
                    if request.HasField("peer_kv") else None)
            out, handle = await worker.prefill(rid, list(request.prompt_token_ids), params,
                                               request.cache_salt or None, lora, peer)
        except Exception as e:
            await abort_with(context, e, rid, "Prefill")
        first_token_id = out.new_token_ids[0]
        response = pb.PrefillResponse(
            request_id=rid, first_token_id=first_token_id,
            num_cached_tokens=out.num_cached_tokens,
            finish_reason=FINISH_REASONS[out.finish_reason], stop_reason=out.stop_reason)
        if out.new_logprobs:
            response.first_logprobs.CopyFrom(logprobs_to_proto(out.new_logprobs[0]))
        if handle is not None:
            response.kv_transfer_params.CopyFrom(handle_to_proto(handle))
        response.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
        logger.info("[%s] prefilled %d tokens (%d cached), first token %d%s", rid,
                    len(request.prompt_token_ids), out.num_cached_tokens, first_token_id,
                    f", finished: {out.finish_reason.value}" if out.finish_reason else "")
        return response

    async def Pool(self, request: pb.PoolRequest,
                   context: grpc.aio.ServicerContext) -> pb.PoolResponse:
        rid = request.request_id
        try:
            worker = self._worker(new_request=True)
            out = await pool(worker, rid, list(request.prompt_token_ids),
                             request.cache_salt or None,
                             request.normalize if request.HasField("normalize") else None)
        except Exception as e:
            await abort_with(context, e, rid, "Pool")
        params = worker.pooler_config
        logger.debug("[%s] pooled %d tokens (%d cached)", rid, len(request.prompt_token_ids),
                     out.num_cached_tokens)
        return pb.PoolResponse(request_id=rid, data=out.pooled.tolist(),
                               num_prompt_tokens=len(request.prompt_token_ids),
                               num_cached_tokens=out.num_cached_tokens,
                               pooling_type=params.pooling_type if params else "")


def add_prefill_servicer(server: grpc.aio.Server, runtime: ServiceRuntime) -> None:
    engine_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(runtime), server)
    add_kv_peer_servicer(server, runtime)
