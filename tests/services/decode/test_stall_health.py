"""Honest health: a decode whose step loop stalls with work queued reports NOT_SERVING within
--stall-timeout (+ one watchdog interval), the real gateway's /health turns 503, and both
recover when the loop steps again; the stalled request then completes, token-identical.

The stall is the test hook of services/common/readiness.py: while the file named by
ServiceConfig.test_stall_file (env PDSERVE_TEST_STALL_FILE) exists, the engine thread sleeps
before each step that has requests to run.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.common.config import ServiceConfig
from pdserve.services.common.worker import STATE_WAIT_S
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from tests.services.gateway.conftest import running_gateway
from tests.services.helpers import (
    RPC_TIMEOUT,
    channel,
    engine_args,
    greedy,
    service_config,
    start_runtime,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STALL_TIMEOUT = 1.5
CHECK_INTERVAL = ServiceConfig("decode", stall_timeout=STALL_TIMEOUT).stall_check_interval
GATEWAY_HEALTH_INTERVAL = 0.25
POLL = 0.02
"""Seconds between the test's own looks (added to every bound)."""
SLACK = 0.5
"""Event-loop and RPC lag allowed on top of every bound (a shared, busy 2-core machine)."""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stallable(model_path, tmp_path_factory, cluster):
    """A decode of its own (stall hook, short --stall-timeout); the session cluster's prefill
    completes the pair the gateway's /health wants."""
    stall_file = tmp_path_factory.mktemp("stall") / "stall"
    decode = await start_runtime(
        service_config("decode", None, stall_timeout=STALL_TIMEOUT,
                       test_stall_file=str(stall_file)), engine_args(model_path))
    ch = channel(decode.identity.address)
    try:
        await decode.wait_ready(300)
        yield SimpleNamespace(prefill=cluster.prefill, decode=decode, stall_file=stall_file,
                              stub=engine_pb2_grpc.DecodeServiceStub(ch),
                              health=health_pb2_grpc.HealthStub(ch))
    finally:
        stall_file.unlink(missing_ok=True)
        await ch.close()
        await asyncio.wait_for(decode.stop(0.5), 60)


async def _status(s) -> int:
    resp = await s.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT)
    return resp.status


async def _wait(predicate, bound: float) -> float:
    """Seconds until `predicate()` (async) holds; fails past `bound` seconds."""
    start = time.monotonic()
    while not await predicate():
        elapsed = time.monotonic() - start
        assert elapsed <= bound, f"not within {bound:.2f} s"
        await asyncio.sleep(POLL)
    return time.monotonic() - start


async def _generate(s, request_id: str, prompt: list[int]) -> list[int]:
    call = s.stub.Generate(pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                            sampling_params=greedy(12)), timeout=RPC_TIMEOUT)
    chunks = [c async for c in call]
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return [t for c in chunks for t in c.token_ids]


async def test_a_stalled_decode_loop_turns_health_503_and_back(stallable, model_path):
    s = stallable
    prompt = list(range(3000, 3030))
    reference = await _generate(s, "undisturbed", prompt)
    urls = SimpleNamespace(prefill_urls=(s.prefill.identity.address,),
                           decode_urls=(s.decode.identity.address,))
    async with running_gateway(model_path, urls,
                               health_check_interval=GATEWAY_HEALTH_INTERVAL) as gw:

        def gateway_health(code: int):
            async def check() -> bool:
                return (await gw.http.get("/health")).status_code == code
            return check

        await _wait(gateway_health(200), 30)
        assert await _status(s) == SERVING

        # Idle with the file present: no work queued, so no stall.
        s.stall_file.touch()
        await asyncio.sleep(STALL_TIMEOUT + 2 * CHECK_INTERVAL)
        assert await _status(s) == SERVING and not s.decode.watchdog.stalled

        submitted = time.monotonic()
        stalled = asyncio.ensure_future(_generate(s, "stalled", prompt))

        async def not_serving() -> bool:
            return await _status(s) == NOT_SERVING
        await _wait(not_serving, 60)  # loose: the first step (the prefill) comes first
        detected = time.monotonic()
        # The stall began with the last completed step (the hook holds the next one).
        stall_began = s.decode.worker.engine.last_step_time
        assert submitted < stall_began < detected and not stalled.done()
        grpc_latency = detected - stall_began
        # Not before the configured time; within it plus one watchdog interval.
        assert STALL_TIMEOUT <= grpc_latency <= STALL_TIMEOUT + CHECK_INTERVAL + POLL + SLACK
        # /health checks the instances live (the gateway's poll only fills in for a
        # silent one), so it follows the service at once.
        await _wait(gateway_health(503), 2 * SLACK)
        http_latency = time.monotonic() - stall_began
        assert http_latency <= STALL_TIMEOUT + CHECK_INTERVAL + POLL + 2 * SLACK

        await asyncio.sleep(1.0)  # stays NOT_SERVING while the stall lasts
        assert await _status(s) == NOT_SERVING and not stalled.done()
        # GetState answers too, from the engine's counters (the thread takes no ops now).
        for check in (False, True):
            asked = time.monotonic()
            state = await s.stub.GetState(pb.GetStateRequest(check_invariants=check),
                                          timeout=RPC_TIMEOUT)
            waited = time.monotonic() - asked
            assert waited <= STATE_WAIT_S[check] + SLACK, (check, waited)
            assert state.num_running + state.num_waiting == 1 and state.num_used_blocks > 0
            assert state.invariants_ok is not check
        assert state.invariants_error.startswith("not checked")

        s.stall_file.unlink()
        resumed = time.monotonic()

        async def serving() -> bool:
            return await _status(s) == SERVING
        await _wait(serving, CHECK_INTERVAL + POLL + SLACK)
        grpc_recovery = time.monotonic() - resumed
        await _wait(gateway_health(200), 2 * SLACK)
        http_recovery = time.monotonic() - resumed

        tokens = await asyncio.wait_for(stalled, RPC_TIMEOUT)
        assert tokens == reference
    print(f"\nstall_timeout={STALL_TIMEOUT}s check_interval={CHECK_INTERVAL}s "
          f"gateway_health_interval={GATEWAY_HEALTH_INTERVAL}s: NOT_SERVING after "
          f"{grpc_latency:.2f}s of stall, /health 503 after {http_latency:.2f}s; "
          f"SERVING {grpc_recovery:.2f}s and /health 200 {http_recovery:.2f}s after the stall "
          "ended")


class _Clock:
    """The two readings StallWatchdog takes from an AsyncEngine, set by the test."""

    def __init__(self) -> None:
        self.since_progress = 0.0
        self.in_step = 0.0
        self.consecutive_step_failures = 0

    def seconds_since_progress(self) -> float:
        return self.since_progress

    def seconds_in_step(self) -> float:
        return self.in_step


async def test_watchdog_tells_a_long_step_from_a_stall():
    """A running step is work for up to IN_STEP_FACTOR x stall_timeout; a loop that starts no
    step with work queued is a stall after stall_timeout."""
    from pdserve.services.common.readiness import IN_STEP_FACTOR, StallWatchdog

    changes: list[bool] = []

    async def on_change(stalled: bool, seconds: float) -> None:
        changes.append(stalled)

    clock = _Clock()
    dog = StallWatchdog(clock, stall_timeout=30.0, interval=1.0,  # type: ignore[arg-type]
                        on_change=on_change)
    clock.since_progress, clock.in_step = 45.0, 44.0  # one long chunked-prefill step
    assert await dog.check() is False
    clock.since_progress = clock.in_step = 30.0 * IN_STEP_FACTOR + 1  # hung inside the step
    assert await dog.check() is True
    clock.since_progress, clock.in_step = 0.5, 0.0  # the step finished
    assert await dog.check() is False
    clock.since_progress, clock.in_step = 31.0, 0.0  # work queued, no step started
    assert await dog.check() is True
    assert changes == [True, False, True]


async def test_watchdog_turns_not_serving_after_three_failing_steps():
    from pdserve.services.common.readiness import FAILING_STEPS_NOT_SERVING, StallWatchdog

    changes: list[bool] = []

    async def on_change(stalled: bool, seconds: float) -> None:
        changes.append(stalled)

    clock = _Clock()
    for timeout in (30.0, 0.0):  # --stall-timeout 0 disables stalls, not this
        dog = StallWatchdog(clock, stall_timeout=timeout, interval=1.0,  # type: ignore[arg-type]
                            on_change=on_change)
        changes.clear()
        for failures in range(FAILING_STEPS_NOT_SERVING):
            clock.consecutive_step_failures = failures
            assert await dog.check() is False
        clock.consecutive_step_failures = FAILING_STEPS_NOT_SERVING
        assert await dog.check() is True
        clock.consecutive_step_failures = 0  # a step went through
        assert await dog.check() is False
        assert changes == [True, False] and FAILING_STEPS_NOT_SERVING == 3
