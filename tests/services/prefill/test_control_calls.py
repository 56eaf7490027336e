"""Control calls get through a busy prefill (issue 13, item 7): with the engine thread held
inside a step of a long, chunked prompt, Abort (straight and through the gateway's
ChannelPool), ReleaseKV, GetState and the health check all complete before that step does,
and the instance's registration in Redis outlives a step held past its TTL; the aborted
prompt's remaining chunks are never computed, the step in flight's chunk is counted by
pdserve_prompt_tokens_after_abort_total, and no block stays in use or pinned.

The step is held by the engine's fault hook (called on the engine thread before each step), so
"before the step finished" is a fact the test checks, not a race against a clock."""

from __future__ import annotations

import asyncio
import inspect

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.gateway.channel_pool import ChannelPool
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from tests.services.helpers import (
    RPC_TIMEOUT,
    channel,
    engine_args,
    greedy,
    service_config,
    start_runtime,
)
from tests.step_gate import StepGate

pytestmark = pytest.mark.asyncio(loop_scope="session")
CHUNK = 128
PROMPT = 1000  # 8 chunks
HOLD_AT = 3
"""The held step: the long prompt's fourth chunk."""
REGISTRATION_TTL = 1.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def prefill(model_path, redis_server):
    """Registered in the session's Redis (when there is a redis-server) with a short TTL."""
    runtime = await start_runtime(
        service_config("prefill", redis_server.url if redis_server else None,
                       registration_ttl=REGISTRATION_TTL),
        engine_args(model_path, max_num_batched_tokens=CHUNK))
    ch = channel(runtime.identity.address)
    try:
        await runtime.wait_ready(300)
        yield runtime, engine_pb2_grpc.PrefillServiceStub(ch), health_pb2_grpc.HealthStub(ch)
    finally:
        await ch.close()
        await runtime.stop(0.5)


async def _prefill(stub, request_id: str, n: int, max_tokens: int) -> pb.PrefillResponse:
    prompt = [(11 * i + len(request_id)) % 30000 + 100 for i in range(n)]
    return await stub.Prefill(pb.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling_params=greedy(max_tokens, ignore_eos=True)), timeout=RPC_TIMEOUT)


async def _poll(predicate, timeout: float = 60.0) -> None:
    """Until `predicate()` (a bool, or an awaitable of one) holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not ((await ok) if inspect.isawaitable(ok := predicate()) else ok):
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_control_calls_complete_while_a_step_is_in_flight(prefill):
    runtime, stub, health = prefill
    worker = runtime.worker
    metrics_before = worker.metrics.value("prompt_tokens_after_abort_total")
    pinned = await _prefill(stub, "pinned", 40, max_tokens=8)  # its KV waits for a decode
    assert pinned.HasField("kv_transfer_params")

    gate = worker.engine.fault_hook = StepGate(HOLD_AT)
    backend = ChannelPool(rpc_timeout=RPC_TIMEOUT)
    try:
        long_prefill = asyncio.ensure_future(_prefill(stub, "long", PROMPT, max_tokens=8))
        assert await asyncio.to_thread(gate.entered.wait, 120)
        request = worker.engine_core.scheduler.requests["long"]  # held mid-step: safe to read
        steps = worker.engine.num_steps

        # The engine thread is inside the held step; every control call answers anyway.
        aborted = await stub.Abort(pb.AbortRequest(request_ids=["long", "nobody"]),
                                   timeout=RPC_TIMEOUT)
        assert list(aborted.aborted_request_ids) == ["long"]
        released = await stub.ReleaseKV(pb.ReleaseKVRequest(request_id="pinned"),
                                        timeout=RPC_TIMEOUT)
        assert released.released
        state = await stub.GetState(pb.GetStateRequest(), timeout=RPC_TIMEOUT)
        assert state.num_gpu_blocks > 0
        check = await health.Check(health_pb2.HealthCheckRequest(service=""),
                                   timeout=RPC_TIMEOUT)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        backend.abort_soon(runtime.identity.address, "prefill", ["long"], "long")
        await _poll(lambda: backend.control_calls.calls["Abort", "OK"] == 1)
        if runtime.index is not None:  # held past the TTL: the heartbeat goes on
            instance_id = runtime.identity.instance_id
            for _ in range(int(2 * REGISTRATION_TTL / 0.1)):
                listed = await runtime.index.live_instances("prefill")
                assert instance_id in [i.instance_id for i in listed]
                await asyncio.sleep(0.1)
        assert worker.engine.num_steps == steps and not gate.released.is_set()
        assert request.num_computed_tokens == HOLD_AT * CHUNK  # the held one not scheduled yet
    finally:
        gate.released.set()
        await backend.close()

    with pytest.raises(grpc.aio.AioRpcError) as e:
        await long_prefill
    assert e.value.code() == grpc.StatusCode.ABORTED
    # Only the held step's chunk was computed after the abort; the other 4 never were.
    assert request.num_computed_tokens == (HOLD_AT + 1) * CHUNK < PROMPT
    await _poll(lambda: worker.metrics.value("prompt_tokens_after_abort_total")
                - metrics_before == CHUNK)

    async def leak_free() -> bool:
        s = await stub.GetState(pb.GetStateRequest(check_invariants=True), timeout=RPC_TIMEOUT)
        return s.invariants_ok and s.num_used_blocks == 0 and s.num_pinned_blocks == 0 \
            and s.num_running == 0 and s.num_waiting == 0

    await _poll(leak_free)
    assert backend.control_calls.num_failed() == 0
    worker.engine.fault_hook = None

