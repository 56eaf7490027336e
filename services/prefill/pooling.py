"""Pool: a pooling (embedding) model's request on the prefill service (--runner pooling).

    Pool ──▶ engine request (pooling_params, no sampling) ──▶ scheduled with the other
             prompts (chunked, batched, prefix cache used and filled) ──▶ its last chunk:
             the model runner pools the hidden states (shared/engine/pooler.py) and the
             scheduler finishes it ──▶ the pooled vector; its blocks are freed at once

No token is generated, nothing is held for a decode instance and no KV crosses.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc

from pdserve.services.common.errors import ServiceError
from pdserve.shared.engine.scheduler_output import EngineCoreOutput
from pdserve.shared.pooling_params import PoolingParams
from pdserve.shared.request import FinishReason, Request
from pdserve.shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.services.prefill.worker import PrefillWorker


async def pool(worker: PrefillWorker, request_id: str, prompt_token_ids: list[int],
               cache_salt: str | None, normalize: bool | None) -> EngineCoreOutput:
    """Run one pooling request to its end.

    Returns:
        The engine's last output: `pooled` ([hidden_size] fp32 tensor) and
        num_cached_tokens.

    Raises:
        ValueError: a bad prompt (the engine's message: empty, over max_model_len, ...).
        ServiceError: FAILED_PRECONDITION (a generate instance), ALREADY_EXISTS (id in
            use), ABORTED (Abort came first).
    """
    config = worker.pooler_config
    if config is None:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                           "The model does not support pooling: this instance runs --runner "
                           "generate (start it with --runner pooling or --convert embed)")
    if not request_id:
        raise ValueError("request_id must not be empty")
    request = Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=1),
                      cache_salt=cache_salt,
                      pooling_params=PoolingParams.resolve(config, normalize))
    arrival = time.monotonic()
    with worker.active(request_id, "is already in progress"):
        last = None
        async for delta in worker.engine.generate(request):
            last = delta
        if last is None or last.pooled is None or last.finish_reason == FinishReason.ABORT:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted")
        # NOTE: counted as a finished prompt: prompt tokens, no generated token.
        worker.metrics.request_finished(FinishReason.STOP.value, request.num_prompt_tokens, 0,
                                        time.monotonic() - arrival)
        return last
