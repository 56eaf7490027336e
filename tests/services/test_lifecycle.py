"""Instance life cycle: health while loading, pins that nobody fetches, the bounded admission
queue of the decode side, and draining on shutdown. Runs its own two instances, without
Redis: a prefill whose pins expire after 0.5 s and a decode with a 24-block pool."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.cli import main as cli_main
from pdserve.services.common.launch import build_runtime, engine_loader
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from tests.services.helpers import (
    RPC_TIMEOUT,
    Cluster,
    channel,
    engine_args,
    greedy,
    num_handle_blocks,
    service_config,
    start_runtime,
    wait_leak_free,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE = "pdserve.v1.PrefillService"


@dataclass
class Small:
    cluster: Cluster
    while_loading: dict


async def _health(address: str, service: str = "") -> int:
    async with channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT)
    return resp.status


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def small(model_path):
    gate = threading.Event()
    load = engine_loader(engine_args(model_path), "prefill")

    def gated_load():
        gate.wait(300)
        return load()

    prefill = build_runtime(service_config("prefill", None, kv_pin_ttl=0.5),
                            load_engine=gated_load)
    await prefill.start()
    decode = await start_runtime(service_config("decode", None, max_waiting_requests=1),
                                 engine_args(model_path, num_gpu_blocks_override=24))
    address = prefill.identity.address
    seen = {"": await _health(address), SERVICE: await _health(address, SERVICE)}
    async with channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await engine_pb2_grpc.PrefillServiceStub(ch).Prefill(pb.PrefillRequest(
                request_id="early", prompt_token_ids=[1, 2, 3], sampling_params=greedy(2)),
                timeout=RPC_TIMEOUT)
    seen["prefill_call"] = info.value.code()
    gate.set()
    await asyncio.gather(prefill.wait_ready(300), decode.wait_ready(300))
    cluster = Cluster(prefill, decode, None)
    yield Small(cluster, seen)
    await cluster.close()


async def test_health_is_serving_only_once_the_model_is_loaded(small):
    assert small.while_loading[""] == NOT_SERVING
    assert small.while_loading[SERVICE] == NOT_SERVING
    assert small.while_loading["prefill_call"] == grpc.StatusCode.UNAVAILABLE
    address = small.cluster.prefill.identity.address
    assert await _health(address) == SERVING
    assert await _health(address, SERVICE) == SERVING
    assert await asyncio.to_thread(cli_main, ["healthcheck", "--address", address]) == 0


async def test_unfetched_pins_expire(small):
    c = small.cluster
    resp = await c.prefill_stub.Prefill(pb.PrefillRequest(
        request_id="never-fetched", prompt_token_ids=list(range(300, 400)),
        sampling_params=greedy(8)), timeout=RPC_TIMEOUT)
    state = await c.prefill_stub.GetState(pb.GetStateRequest(), timeout=RPC_TIMEOUT)
    assert state.num_pinned_blocks == num_handle_blocks(resp.kv_transfer_params) == 7
    prefill_state, _ = await wait_leak_free(c, timeout=20)
    assert prefill_state.num_pinned_blocks == prefill_state.num_used_blocks == 0
    assert prefill_state.num_free_blocks == prefill_state.num_gpu_blocks - 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in c.prefill_stub.FetchKV(pb.FetchKVRequest(request_id="never-fetched"),
                                              timeout=RPC_TIMEOUT):
            pass
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.fixture
def long_pins(small):
    """b waits seconds for blocks: its pin must outlive the module's 0.5 s TTL meanwhile."""
    worker = small.cluster.prefill.worker
    config = worker.config
    worker.config = dataclasses.replace(config, kv_pin_ttl=120.0)
    yield
    worker.config = config


async def test_decode_admits_only_what_its_pool_holds(small, long_pins):
    c = small.cluster
    params = greedy(40, ignore_eos=True)

    async def prefill(rid: str, offset: int) -> pb.DecodeRequest:
        prompt = [100 + offset + i for i in range(200)]  # 13 blocks of the 23 usable
        resp = await c.prefill_stub.Prefill(pb.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling_params=params),
            timeout=RPC_TIMEOUT)
        return pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                output_token_ids=[resp.first_token_id], sampling_params=params,
                                kv_transfer_params=resp.kv_transfer_params)

    req_a, req_b, req_c = await asyncio.gather(prefill("a", 0), prefill("b", 1000),
                                               prefill("c", 2000))
    stream_a = c.decode_stub.Generate(req_a, timeout=RPC_TIMEOUT)
    first_a = await stream_a.read()
    assert first_a.token_ids
    # b waits for blocks: a holds 13+ of 23, b needs 13 (plus a watermark block).
    task_b = asyncio.ensure_future(_collect(c.decode_stub.Generate(req_b, timeout=RPC_TIMEOUT)))
    async def num_waiting() -> int:  # b, WAITING_FOR_REMOTE_KVS in the decode's scheduler
        state = await c.decode_stub.GetState(pb.GetStateRequest(), timeout=RPC_TIMEOUT)
        return state.num_waiting

    for _ in range(400):
        if await num_waiting() == 1:
            break
        await asyncio.sleep(0.01)
    assert await num_waiting() == 1
    # The waiting queue holds one request: c is turned away.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(c.decode_stub.Generate(req_c, timeout=RPC_TIMEOUT))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    rest_a = await _read_rest(stream_a)
    assert 1 + len(first_a.token_ids) + sum(len(x.token_ids) for x in rest_a) == 40
    chunks_b = await task_b
    assert 1 + sum(len(x.token_ids) for x in chunks_b) == 40
    await c.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id="c"), timeout=RPC_TIMEOUT)
    for state in await wait_leak_free(c):
        assert state.num_used_blocks == state.num_pinned_blocks == 0, state


async def test_drain_finishes_in_flight_requests_and_refuses_new_ones(small):
    c = small.cluster
    req = pb.DecodeRequest(request_id="drain", prompt_token_ids=list(range(500, 540)),
                           sampling_params=greedy(30, ignore_eos=True))
    stream = c.decode_stub.Generate(req, timeout=RPC_TIMEOUT)
    first = await stream.read()
    stopping = asyncio.ensure_future(c.decode.stop(grace=60))
    address = c.decode.identity.address
    for _ in range(200):
        if await _health(address) == NOT_SERVING:
            break
        await asyncio.sleep(0.01)
    assert await _health(address) == NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        req2 = pb.DecodeRequest(request_id="late", prompt_token_ids=[1, 2, 3],
                                sampling_params=greedy(2))
        await _collect(c.decode_stub.Generate(req2, timeout=RPC_TIMEOUT))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = await _read_rest(stream)
    assert len(first.token_ids) + sum(len(x.token_ids) for x in rest) == 30
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    await stopping


async def _collect(call) -> list:
    return [item async for item in call]


async def _read_rest(call) -> list:
    """The rest of a stream already read with `read()` (the two styles cannot be mixed)."""
    items = []
    while (item := await call.read()) is not grpc.aio.EOF:
        items.append(item)
    return items
