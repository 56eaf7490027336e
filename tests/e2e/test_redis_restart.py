"""Redis stopped and restarted during a 200-request run (issue 6 acceptance): no request
fails; the gateway places from its last view of the registry while Redis is down (issue 37:
its RegistryView, never a Redis call per request); afterwards each instance republishes its
cache (the index matches again) and the gateway's cache-aware routing sees the instances and
their cached prefixes again.

The real gateway (with --redis-url and the static lists) in front of real prefill and
decode services; one real redis-server, stopped and started on the same port (empty, as
after a crash). If the services export `pdserve_redis_up`, it must read 0 during the
outage and 1 after.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from pdserve.shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens
from tests.e2e.conftest import Urls
from tests.e2e.soak_helpers import Plan, complete_problems, make_plan, send, shared_prefixes
from tests.services.gateway.conftest import RunningGateway, running_gateway
from tests.services.helpers import Cluster, RedisServer, cached_hashes, index_matches

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

NUM_REQUESTS = 200
CONCURRENCY = 16
STOP_AFTER = 50
"""Completed requests before Redis is stopped."""
OUTAGE_SECONDS = 3.0
SEED = 7


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(redis_cluster) -> Cluster:
    return redis_cluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(model_path, cluster, redis_server) -> AsyncIterator[RunningGateway]:
    urls = Urls((cluster.prefill.identity.address,), (cluster.decode.identity.address,))
    async with running_gateway(model_path, urls,  # type: ignore[arg-type]
                               served_model_name=cluster.prefill.worker.model_name,
                               redis_url=redis_server.url, rpc_timeout=10.0) as gw:
        yield gw


async def redis_up_values(http: httpx.AsyncClient, cluster: Cluster) -> list[float] | None:
    """`pdserve_redis_up` of each service, scraped from its /metrics; None if not exported."""
    values = []
    for runtime in cluster.runtimes:
        text = (await http.get(f"http://127.0.0.1:{runtime.metrics_port}/metrics")).text
        found = [s.value for f in text_string_to_metric_families(text)
                 for s in f.samples if s.name == "pdserve_redis_up"]
        if not found:
            return None
        values.append(min(found))
    return values


@dataclass
class OutageRun:
    plans: list[Plan]
    results: dict[int, object] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    outage: tuple[float, float] = (0.0, 0.0)
    """(stop, start) of redis-server, monotonic seconds."""
    finished_at: dict[int, float] = field(default_factory=dict)
    registry_during: tuple | None = None
    """(live instance ids, is_up) of the gateway's registry view during the outage."""
    gauge_during: list[float] | None = None
    gauge_exported: bool = False
    seconds: float = 0.0

    @property
    def completed_during_outage(self) -> int:
        stop, start = self.outage
        return sum(stop < t < start for t in self.finished_at.values())


async def prompt_hashes(gw: RunningGateway, text: str) -> list[bytes]:
    """The block hashes the gateway's placement looks up for a completion prompt."""
    resp = await gw.http.post("/tokenize", json={"prompt": text})
    info = await gw.app.state.gateway.engine.engine_info()
    return hash_request_tokens(resp.json()["tokens"], info.block_size,
                               block_extra_keys(info.model_name, None, info.quantization))


async def run_with_outage(gw: RunningGateway, cluster: Cluster,
                          redis: RedisServer) -> OutageRun:
    rng = random.Random(SEED)
    prefixes = shared_prefixes(SEED)
    model = gw.config.served_model_name
    run = OutageRun([make_plan(i, rng, model, prefixes, {}) for i in range(NUM_REQUESTS)])
    registry = gw.app.state.gateway.engine.placer.registry
    semaphore = asyncio.Semaphore(CONCURRENCY)
    enough = asyncio.Event()

    async def one(http: httpx.AsyncClient, plan: Plan) -> None:
        async with semaphore:
            try:
                result = await send(http, plan)
            except Exception as e:  # a dropped connection is a failed request too
                run.problems.append(f"#{plan.index}: {type(e).__name__}: {e}")
                return
        run.results[plan.index] = result
        run.finished_at[plan.index] = time.monotonic()
        run.problems += [f"#{plan.index}: {p}" for p in complete_problems(plan, result)]
        if len(run.finished_at) >= STOP_AFTER:
            enough.set()

    async def outage(http: httpx.AsyncClient) -> None:
        await asyncio.wait_for(enough.wait(), 120)
        await asyncio.to_thread(redis.stop)
        stop = time.monotonic()
        gauge = None
        while time.monotonic() - stop < 10:
            gauge = await redis_up_values(http, cluster)
            if time.monotonic() - stop >= OUTAGE_SECONDS and (gauge is None or not any(gauge)):
                break
            await asyncio.sleep(0.1)
        run.gauge_exported, run.gauge_during = gauge is not None, gauge
        run.registry_during = ({i.instance_id for i in await registry.live_instances()},
                               registry.is_up)
        await asyncio.to_thread(redis.start)  # same port, empty
        run.outage = (stop, time.monotonic())

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=gw.url, timeout=60, limits=httpx.Limits(
            max_connections=2 * CONCURRENCY)) as http:
        controller = asyncio.ensure_future(outage(http))
        await asyncio.gather(*(one(http, p) for p in run.plans))
        await controller
    run.seconds = time.monotonic() - t0
    return run


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def outage_run(gateway, cluster, redis_server) -> OutageRun:
    assert await index_matches(cluster), "the index must match before the outage"
    run = await run_with_outage(gateway, cluster, redis_server)
    stop, start = run.outage
    print(f"\nREDIS-RESTART requests={NUM_REQUESTS} concurrency={CONCURRENCY} "
          f"outage={start - stop:.1f}s completed_during_outage={run.completed_during_outage} "
          f"completed_after={sum(t > start for t in run.finished_at.values())} "
          f"failures={len(run.problems)} gauge_during={run.gauge_during} "
          f"run={run.seconds:.1f}s")
    return run


async def test_no_request_fails_while_redis_restarts(outage_run, cluster):
    assert not outage_run.problems, "\n".join(outage_run.problems[:20])
    assert len(outage_run.results) == NUM_REQUESTS
    assert all(r.status == 200 for r in outage_run.results.values())
    stop, start = outage_run.outage
    assert start - stop >= 1.0
    # Requests really ran while Redis was down, and after it came back.
    assert outage_run.completed_during_outage >= 5
    assert sum(t > start for t in outage_run.finished_at.values()) >= 5
    # ... and the gateway served them from its last view of the registry (it knew Redis
    # was down and still listed both instances).
    live, is_up = outage_run.registry_during
    assert live == {cluster.prefill.identity.instance_id, cluster.decode.identity.instance_id}
    assert is_up is False


async def test_index_republished_and_cache_aware_routing_resumes(outage_run, gateway, cluster):
    t0 = time.monotonic()
    assert await index_matches(cluster, timeout=20)
    republished = time.monotonic() - t0
    registry = gateway.app.state.gateway.engine.placer.registry
    prompt = shared_prefixes(SEED)[0]
    resp = await gateway.http.post("/v1/completions", json={
        "model": gateway.config.served_model_name, "prompt": prompt, "max_tokens": 2,
        "temperature": 0})
    assert resp.status_code == 200
    hashes = await prompt_hashes(gateway, prompt)
    assert len(hashes) >= 1
    # What the gateway's routing must see: each instance's leading cached blocks.
    expected = {}
    for runtime in cluster.runtimes:
        held = await cached_hashes(runtime)
        n = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
        if n:
            expected[runtime.identity.instance_id] = n
    assert cluster.prefill.identity.instance_id in expected
    ids = {r.identity.instance_id for r in cluster.runtimes}
    deadline = time.monotonic() + 20  # the gateway's reconnection backoff is at most 5 s
    while True:
        await cluster.prefill.monitor.flush()
        live = {i.instance_id for i in await registry.live_instances()}
        seen = await registry.longest_prefix(hashes)
        if (live == ids and seen == expected) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    resumed = time.monotonic() - t0
    print(f"\nREDIS-RESTART index_republished={republished:.2f}s routing_resumed={resumed:.2f}s")
    assert live == ids
    assert seen == expected
    assert registry.is_up


async def test_redis_up_gauge_follows_the_outage(outage_run, cluster):
    if not outage_run.gauge_exported:
        pytest.skip("the services do not export pdserve_redis_up")
    assert outage_run.gauge_during == [0.0] * len(cluster.runtimes)
    deadline = time.monotonic() + 20
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            values = await redis_up_values(http, cluster)
            if values == [1.0] * len(cluster.runtimes) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    assert values == [1.0] * len(cluster.runtimes)
