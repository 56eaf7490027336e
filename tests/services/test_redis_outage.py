"""Redis goes away in the middle of a run: requests keep succeeding; once it is back (empty,
as after a restart) each instance republishes and the index matches its cache again. The
`pdserve_redis_up` gauge of each instance's /metrics follows: 1, 0 during the outage, 1."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest

from pdserve.services.proto import engine_pb2 as pb
from tests.services.helpers import cached_hashes, greedy, index_matches, run_split

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(40, 90))]
            for _ in range(count)]


async def test_requests_survive_a_redis_outage_and_the_index_recovers(cluster, redis):
    results = await asyncio.gather(*(run_split(cluster, f"before-{i}", p, greedy(6))
                                     for i, p in enumerate(_prompts(1, 4))))
    assert all(r.finish_reason == pb.FINISH_REASON_LENGTH for r in results)
    assert await index_matches(cluster)
    assert await _wait_redis_up(cluster, 1) == [1, 1]

    redis.stop()
    results = await asyncio.gather(*(run_split(cluster, f"during-{i}", p, greedy(6))
                                     for i, p in enumerate(_prompts(2, 6))))
    assert all(len(r.token_ids) == 6 for r in results)
    # The index answers at once with "nothing known" rather than hanging.
    assert await cluster.index.longest_prefix([b"\0" * 16]) == {}
    assert await cluster.index.live_instances() == []
    assert not cluster.prefill.index.is_up or not cluster.decode.index.is_up
    # Within a heartbeat (0.2 s here) every instance has tried Redis and reports it down.
    assert await _wait_redis_up(cluster, 0) == [0, 0]

    redis.start()  # same port, no data: as after a crash
    for runtime in cluster.runtimes:
        assert await cached_hashes(runtime), "nothing to republish: the check would be void"
    assert await index_matches(cluster)
    assert await _wait_redis_up(cluster, 1) == [1, 1]
    live = await _wait_live(cluster, 2)
    assert {i.instance_id for i in live} == {r.identity.instance_id for r in cluster.runtimes}
    results = await asyncio.gather(*(run_split(cluster, f"after-{i}", p, greedy(6))
                                     for i, p in enumerate(_prompts(3, 2))))
    assert all(len(r.token_ids) == 6 for r in results)
    assert await index_matches(cluster)


async def _wait_live(cluster, count: int, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        live = await cluster.index.live_instances()
        if len(live) >= count or time.monotonic() > deadline:
            return live
        await asyncio.sleep(0.1)


async def _redis_up(runtime) -> int | None:
    """The instance's pdserve_redis_up, read from its real Prometheus endpoint."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"http://127.0.0.1:{runtime.metrics_port}/metrics")).text
    match = re.search(r"^pdserve_redis_up\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return None if match is None else int(float(match.group(1)))


async def _wait_redis_up(cluster, value: int, timeout: float = 20.0) -> list[int | None]:
    deadline = time.monotonic() + timeout
    while True:
        got = [await _redis_up(r) for r in cluster.runtimes]
        if got == [value] * len(got) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


class FrozenWrites:
    """A PrefixIndex whose every write waits until `thaw()`: a Redis that stopped answering
    (as under SIGSTOP, without the socket timeout, so a wait would show as a hang)."""

    def __init__(self, index) -> None:
        self.index = index
        self.thawed = asyncio.Event()
        self.num_waiting = 0

    def __getattr__(self, name):
        return getattr(self.index, name)

    async def _frozen(self, name: str, *args):
        self.num_waiting += 1
        await self.thawed.wait()
        return await getattr(self.index, name)(*args)

    async def register(self, *args):
        return await self._frozen("register", *args)

    async def publish(self, *args):
        return await self._frozen("publish", *args)

    async def republish(self, *args):
        return await self._frozen("republish", *args)


def _dropped(runtime) -> float:
    return runtime.worker.metrics.registry.get_sample_value(
        "pdserve_prefix_index_writes_dropped_total",
        {"model_name": runtime.worker.model_name}) or 0.0


async def test_a_frozen_redis_never_holds_up_the_engine_and_drops_are_counted(
        cluster, redis, monkeypatch):
    """Issue 37: the prefix-index writes are asynchronous and bounded: with every Redis write
    hanging, ticks still drain the engine and requests are served; changes past the bound
    are dropped and counted; once Redis answers, the whole hash map is republished."""
    from pdserve.services.common import monitor as monitor_module

    runtime = cluster.decode
    monitor = runtime.monitor
    await monitor.flush()
    assert not monitor.dirty
    frozen = FrozenWrites(monitor.index)
    monkeypatch.setattr(monitor, "index", frozen)
    monkeypatch.setattr(monitor_module, "MAX_PENDING_HASHES", 4)
    dropped_before = _dropped(runtime)
    try:
        prompts = _prompts(4, 3)
        first = await run_split(cluster, "frozen-0", prompts[0], greedy(4))
        await asyncio.wait_for(monitor.tick(), 60)  # queued, not written
        deadline = time.monotonic() + 30
        while frozen.num_waiting == 0:  # the writer task is stuck in Redis now
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        results = await asyncio.gather(*(run_split(cluster, f"frozen-{i}", p, greedy(4))
                                         for i, p in enumerate(prompts[1:], 1)))
        await asyncio.wait_for(monitor.tick(), 60)
        assert [len(r.token_ids) for r in [first, *results]] == [4, 4, 4]
        assert _dropped(runtime) > dropped_before  # past MAX_PENDING_HASHES: dropped
        assert monitor.dirty  # ... so the whole map goes out at the next write
    finally:
        frozen.thawed.set()
    monkeypatch.undo()
    assert await index_matches(cluster)
    assert not monitor.dirty
