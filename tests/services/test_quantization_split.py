"""Prefill and decode must run the same weight quantization: an int8 split serves end to end;
KV computed under one mode is refused by a decode instance of the other (FAILED_PRECONDITION,
naming both modes) and nothing leaks."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio

from pdserve.services.proto import engine_pb2 as pb
from tests.conftest import TEST_QUANTIZATION
from tests.services.helpers import (
    RPC_TIMEOUT,
    greedy,
    run_split,
    start_cluster,
    wait_leak_free,
)

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

PROMPT = [1, 9690, 28, 2] + list(range(1000, 1060))  # 64 tokens: 4 full blocks


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def int8_cluster(model_path):
    c = await start_cluster(model_path, None, quantization="int8")
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fp32_cluster(model_path, cluster):
    """The suite's cluster, or an fp32 one of its own when the suite runs int8."""
    if TEST_QUANTIZATION == "none":
        yield cluster
        return
    c = await start_cluster(model_path, None, quantization="none")
    yield c
    await c.close()


async def _prefill(cluster, request_id: str) -> pb.PrefillResponse:
    return await cluster.prefill_stub.Prefill(pb.PrefillRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling_params=greedy(8)),
        timeout=RPC_TIMEOUT)


async def _refused(cluster, request_id: str, resp: pb.PrefillResponse) -> tuple:
    req = pb.DecodeRequest(request_id=request_id, prompt_token_ids=PROMPT,
                           output_token_ids=[resp.first_token_id], sampling_params=greedy(8),
                           kv_transfer_params=resp.kv_transfer_params)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _ = [c async for c in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT)]
    return info.value.code(), info.value.details()


async def test_int8_split_serves_end_to_end(int8_cluster):
    state = await int8_cluster.prefill_stub.GetState(pb.GetStateRequest(), timeout=RPC_TIMEOUT)
    assert state.quantization == "int8"
    split = await run_split(int8_cluster, "int8-split", PROMPT, greedy(16, ignore_eos=True))
    assert split.prefill.kv_transfer_params.quantization == "int8"
    assert len(split.token_ids) == 16
    # the same prompt prefilled by the int8 decode instance itself: the same tokens
    local = [c async for c in int8_cluster.decode_stub.Generate(pb.DecodeRequest(
        request_id="int8-local", prompt_token_ids=PROMPT,
        sampling_params=greedy(16, ignore_eos=True)), timeout=RPC_TIMEOUT)]
    assert [t for c in local for t in c.token_ids] == split.token_ids
    await wait_leak_free(int8_cluster)


async def test_int8_prefill_to_fp32_decode_is_refused(int8_cluster, fp32_cluster):
    cluster = fp32_cluster
    resp = await _prefill(int8_cluster, "int8-to-fp32")
    assert resp.kv_transfer_params.quantization == "int8"
    code, details = await _refused(cluster, "int8-to-fp32", resp)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'int8'" in details and "'none'" in details and "quantization" in details
    await int8_cluster.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id="int8-to-fp32"),
                                              timeout=RPC_TIMEOUT)
    _, decode_state = await wait_leak_free(cluster, decode_only=True)
    assert decode_state.num_used_blocks == 0


async def test_fp32_prefill_to_int8_decode_is_refused(int8_cluster, fp32_cluster):
    cluster = fp32_cluster
    resp = await _prefill(cluster, "fp32-to-int8")
    assert resp.kv_transfer_params.quantization == "none"
    code, details = await _refused(int8_cluster, "fp32-to-int8", resp)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'none'" in details and "'int8'" in details
    await cluster.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id="fp32-to-int8"),
                                         timeout=RPC_TIMEOUT)
    for state in await wait_leak_free(int8_cluster):
        assert state.num_used_blocks == 0 and state.num_pinned_blocks == 0, state
