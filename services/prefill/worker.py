"""PrefillWorker: prefill a prompt, sample its first token, serve its KV to the decode.

    Prefill ──▶ KVHolding.hold: engine request (max_tokens 1, RemoteDecode)
                  │ finished: the scheduler holds its blocks ──▶ KVHandle
    FetchKV / ReleaseKV / Abort / TTL: KVHolding (services/common/kv_holding.py)
    PeerKV hint: the prefix a peer holds is fetched first (KVReceiving, the peer tier)
"""

from __future__ import annotations

import grpc

from pdserve.services.common.errors import ServiceError
from pdserve.services.common.kv_receiving import KVReceiving, PeerHint
from pdserve.shared.engine.scheduler_output import EngineCoreOutput
from pdserve.shared.kv_transfer.params import KVHandle
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.sampling_params import SamplingParams


class PrefillWorker(KVReceiving):
    role = "prefill"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pooler_config = self.engine_core.model_config.pooler_config
        """The model's pooler with --runner pooling (Pool only: pooling.py); None: generate."""

    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, cache_salt: str | None,
                      lora_request: LoRARequest | None = None, peer: PeerHint | None = None
                      ) -> tuple[EngineCoreOutput, KVHandle | None]:
        """Compute the prompt's KV, sample the first token and hold the blocks for the
        decode (`KVHolding.hold`); with `peer`, the prefix it holds is fetched from it
        first (the peer tier).

        Raises:
            ValueError: a bad prompt (the engine's message).
            ServiceError: FAILED_PRECONDITION (a pooling instance), ALREADY_EXISTS (request
                id in use), ABORTED (Abort came first).
        """
        if self.pooler_config is not None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "The model does not support generation: this instance runs "
                               "--runner pooling (Pool only)")
        return await self.hold(request_id, prompt_token_ids, params, cache_salt, lora_request,
                               peer=peer)

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Abort prefills in flight and release finished ones, without waiting for the
        engine thread (a prefill's uncomputed chunks are dropped before the next step)."""
        aborted = set(self.engine.request_abort(request_ids))
        aborted.update(self.close_held(request_ids))
        return [r for r in request_ids if r in aborted]
