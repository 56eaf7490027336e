"""The decode instance validates a request once (issue 33): `DecodeWorker.make_request` runs
`EngineCore.validate_request` before any block is held or KV fetched, and the engine trusts
it when the request is added (before, `EngineCore.add_request` ran it a second time). Through
real prefill and decode services: a split request, a local prefill on the decode (no handle)
and a refused request each cost the decode exactly one validation."""

from __future__ import annotations

import grpc
import pytest

from pdserve.services.proto import engine_pb2 as pb
from tests.services.helpers import RPC_TIMEOUT, greedy, run_split, wait_leak_free

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def validations(cluster, monkeypatch) -> list[str]:
    """The request ids the decode's engine validates, in order."""
    engine_core = cluster.decode.worker.engine_core
    real = engine_core.validate_request
    seen: list[str] = []

    def counting(request):
        seen.append(request.request_id)
        return real(request)

    monkeypatch.setattr(engine_core, "validate_request", counting)
    return seen


async def test_a_split_request_is_validated_once_on_the_decode(cluster, parity_prompt_ids,
                                                                validations):
    result = await run_split(cluster, "validate-once-split", parity_prompt_ids[0],
                             greedy(6, ignore_eos=True))
    assert len(result.token_ids) == 6
    assert validations == ["validate-once-split"]
    await wait_leak_free(cluster)


async def test_a_local_prefill_and_a_refusal_are_validated_once(cluster, parity_prompt_ids,
                                                                validations):
    prompt = parity_prompt_ids[1]
    req = pb.DecodeRequest(request_id="validate-once-local", prompt_token_ids=prompt,
                           sampling_params=greedy(4, ignore_eos=True))
    chunks = [c async for c in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT)]
    assert sum(len(c.token_ids) for c in chunks) == 4
    bad = pb.DecodeRequest(request_id="validate-once-bad", prompt_token_ids=prompt,
                           sampling_params=greedy(10 ** 6))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in cluster.decode_stub.Generate(bad, timeout=RPC_TIMEOUT):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in info.value.details() or "max_model_len" in info.value.details()
    assert validations == ["validate-once-local", "validate-once-bad"]
    await wait_leak_free(cluster)
