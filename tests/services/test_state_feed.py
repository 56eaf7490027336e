"""The state feed (services/common/state_feed.py): the block pool's change tracking, and a
watcher's map, rebuilt from one snapshot plus deltas, equal to the pool at every frame,
its counts equal to the leak audit's (stats_op) of that moment."""

from __future__ import annotations

import asyncio
import math
import random

from pdserve.services.common.state_feed import (
    BLOCK_CACHED,
    BLOCK_NULL,
    BLOCK_PINNED,
    MAX_BACKLOG,
    STATE_MASK,
    block_state,
    count_states,
)
from pdserve.services.gateway.dashboard import frame_json
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from pdserve.shared.kv_cache.block_pool import BlockPool
from tests.services.churn import ChurnEngine, feed
from tests.services.helpers import (
    FILL_POOL_BLOCKS,
    channel,
    engine_args,
    fill_disk_tier,
    service_config,
    start_runtime,
)


def test_block_pool_reports_every_changed_block_once_tracking_is_on():
    pool = BlockPool(10, enable_caching=True)
    a = pool.get_new_blocks(3)
    assert pool.take_changed_block_ids() == []  # off: nothing recorded
    pool.track_changes(True)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [b"h1", b"h2"], 0, 2)
    pool.free_blocks(a)
    pool.touch([a[0]])
    assert pool.take_changed_block_ids() == sorted({x.block_id for x in a + b})
    assert pool.take_changed_block_ids() == []
    pool.free_blocks([a[0]])
    pool.free_blocks(b)
    assert pool.reset_prefix_cache()
    assert pool.take_changed_block_ids() == sorted({a[0].block_id, a[1].block_id,
                                                    *(x.block_id for x in b)})
    pool.track_changes(False)
    pool.get_new_blocks(1)
    assert pool.take_changed_block_ids() == []


def _truth(engine, pinned: set[int]) -> bytes:
    pool = engine.kv_cache_manager.block_pool
    out = bytearray(block_state(b) for b in pool.blocks)
    out[0] = BLOCK_NULL
    for i in pinned:
        out[i] = (out[i] & ~STATE_MASK) | BLOCK_PINNED
    return bytes(out)


def _apply(block_map: bytearray | None, frame) -> bytearray:
    if frame.snapshot:
        return bytearray(frame.block_states)
    assert block_map is not None
    for i, s in zip(frame.changed_block_ids, frame.block_states, strict=True):
        block_map[i] = s
    return block_map


def _audit(state) -> dict[str, int]:
    return {k: getattr(state, k) for k in ("num_free_blocks", "num_used_blocks",
                                            "num_pinned_blocks", "num_cached_blocks")}


async def test_a_watchers_map_is_the_pool_at_every_frame():
    engine = ChurnEngine(num_blocks=300, seed=1)
    pinned: set[int] = set()
    truth: dict[int, bytes] = {}
    state_feed = feed(engine, pinned,
                      on_sample=lambda s: truth.__setitem__(state_feed.seq + 1,
                                                            _truth(engine, pinned)))
    rng = random.Random(2)
    frames = []

    async def consume():
        block_map = None
        async for frame in state_feed.watch(0.05):
            block_map = _apply(block_map, frame)
            assert bytes(block_map) == truth[frame.seq], frame.seq
            assert count_states(block_map) == _audit(frame.state)
            frames.append(frame)
            if len(frames) >= 40:
                return

    consumer = asyncio.ensure_future(consume())
    while not consumer.done():
        if rng.random() < 0.5:
            engine.add(rng.randrange(1, 4))
        engine.step()
        # Pins are always blocks some request holds (a finished prefill's, in the service).
        used = [b.block_id for b in engine.kv_cache_manager.block_pool.blocks[1:] if b.ref_cnt]
        pinned.clear()
        pinned.update(rng.sample(used, min(len(used), rng.randrange(0, 6))))
        await asyncio.sleep(0.01)
    await consumer
    await state_feed.aclose()
    assert frames[0].snapshot and not any(f.snapshot for f in frames[1:])
    assert [f.seq for f in frames] == list(range(frames[0].seq, frames[0].seq + len(frames)))
    assert any(f.changed_block_ids for f in frames)
    assert any(f.state.num_pinned_blocks for f in frames)
    assert any(f.state.num_used_blocks for f in frames)
    assert any(count_states(f.block_states)["num_cached_blocks"] for f in frames if f.snapshot) \
        or any(s & BLOCK_CACHED for f in frames for s in f.block_states)
    # Every request of a frame lists its block table; running ones hold blocks.
    assert any(r.status == "running" and r.block_ids for f in frames for r in f.requests)


async def test_a_watcher_that_falls_behind_gets_a_fresh_snapshot():
    engine = ChurnEngine(num_blocks=200, seed=3)
    state_feed = feed(engine)
    watch = aiter(state_feed.watch(0.05))
    first = await anext(watch)
    assert first.snapshot
    for _ in range(MAX_BACKLOG + 4):  # let frames pile up unread
        engine.add(2)
        engine.step()
        await asyncio.sleep(0.06)
    await asyncio.sleep(0.2)  # one more tick after the last step
    frame = await anext(watch)
    assert frame.snapshot and frame.seq > first.seq + MAX_BACKLOG
    assert bytes(frame.block_states) == _truth(engine, set())  # nothing stepped since
    nxt = await anext(watch)
    assert not nxt.snapshot and nxt.seq == frame.seq + 1
    await watch.aclose()
    await state_feed.aclose()


async def test_tracking_stops_when_nobody_watches_and_a_new_watcher_starts_with_a_snapshot():
    engine = ChurnEngine(num_blocks=100, seed=4)
    pool = engine.kv_cache_manager.block_pool
    state_feed = feed(engine)
    watch = aiter(state_feed.watch(0.05))
    assert (await anext(watch)).snapshot
    assert pool._changed is not None
    await watch.aclose()
    for _ in range(50):
        if pool._changed is None:
            break
        await asyncio.sleep(0.02)
    assert pool._changed is None and state_feed.num_watchers == 0
    engine.add(3)
    engine.step()
    watch = aiter(state_feed.watch(0.05))
    frame = await anext(watch)
    assert frame.snapshot and bytes(frame.block_states) == _truth(engine, set())
    await watch.aclose()
    await state_feed.aclose()


def test_a_100000_block_snapshot_is_one_byte_per_block():
    engine = ChurnEngine(num_blocks=100_000, seed=5)
    engine.add(20)
    engine.step()
    from pdserve.services.common.state_feed import feed_op
    from pdserve.services.common.worker import stats_op

    sample = feed_op(engine, True, stats_op)
    assert len(sample.block_states) == 100_000
    counts = count_states(sample.block_states)
    assert counts["num_used_blocks"] == sample.stats.num_used_blocks > 0
    assert counts["num_free_blocks"] == sample.stats.num_free_blocks


def test_the_feed_and_the_leak_audit_name_a_block_holder_nobody_owns():
    from pdserve.services.common.state_feed import feed_op
    from pdserve.services.common.worker import check_invariants_op, stats_op
    from pdserve.shared.request import Request
    from pdserve.shared.sampling_params import SamplingParams

    engine = ChurnEngine(num_blocks=100, seed=6)
    engine.add(4)
    engine.step()
    assert check_invariants_op(engine) == ("", [])
    sample = feed_op(engine, True, stats_op)
    assert {r.status for r in sample.requests} <= {"running", "waiting"}
    paused = next(r.request_id for r in sample.requests if r.status == "running")
    engine.scheduler.pause_requests([paused])
    assert [r.request_id for r in feed_op(engine, False, stats_op).requests
            if r.status == "paused"] == [paused]
    leaked = Request("leaked", list(range(1, 40)), SamplingParams(max_tokens=1))
    assert engine.kv_cache_manager.allocate_slots(leaked, 39) is not None
    assert check_invariants_op(engine) == ("", ["leaked"])
    held = [r for r in feed_op(engine, False, stats_op).requests if r.status == "held"]
    assert [(r.request_id, r.block_ids) for r in held] == [
        ("leaked", engine.kv_cache_manager.get_block_ids("leaked"))]


# ---------------------------------------------------------------- KV tiers (issue 30)

def _metric_samples(text: str) -> dict[tuple, float]:
    """/metrics text -> {(sample name, tier, op, le): value} of the pdserve_kv_tier_* series."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, s.labels.get("tier"), s.labels.get("op"), s.labels.get("le")): s.value
            for f in text_string_to_metric_families(text) if f.name.startswith("pdserve_kv_tier")
            for s in f.samples}


def _expected_tiers(samples: dict[tuple, float]) -> list[dict]:
    """The frame's tiers as /metrics has them (tier_metrics.py's series, per tier)."""
    def v(name: str, tier: str, op: str | None = None) -> int:
        return int(samples.get((f"pdserve_kv_tier_{name}", tier, op, None), 0))

    buckets = sorted(((math.inf if le == "+Inf" else float(le)), int(value))
                     for (name, _, _, le), value in samples.items()
                     if name == "pdserve_kv_tier_load_seconds_bucket")
    load = {"bounds": [b for b, _ in buckets], "counts": [c for _, c in buckets],
            "sum": samples[("pdserve_kv_tier_load_seconds_sum", None, None, None)]}
    return [{"tier": tier, "blocks": v("blocks", tier), "bytes": v("bytes", tier),
             "queries": v("queries_total", tier), "hits": v("hits_total", tier),
             "stores": v("stores_total", tier), "loads": v("loads_total", tier),
             "failures": v("failures_total", tier, "store") + v("failures_total", tier, "load"),
             "evictions": v("evictions_total", tier),
             "load_seconds": load if tier == "disk" else None}
            for tier in ("memory", "disk")]


def _frame_tiers(frame) -> list[dict]:
    return [{"tier": t.tier, "blocks": t.blocks, "bytes": t.bytes, "queries": t.queries,
             "hits": t.hits, "stores": t.stores, "loads": t.loads, "failures": t.failures,
             "evictions": t.evictions,
             "load_seconds": {"bounds": list(t.load_seconds.bounds),
                              "counts": list(t.load_seconds.counts), "sum": t.load_seconds.sum}
             if t.HasField("load_seconds") else None}
            for t in frame.tiers]


async def _first_frame(runtime):
    stub_type = (engine_pb2_grpc.PrefillServiceStub if runtime.worker.role == "prefill"
                 else engine_pb2_grpc.DecodeServiceStub)
    async with channel(runtime.identity.address) as ch:
        call = stub_type(ch).WatchState(pb.WatchStateRequest(interval_s=0.05), timeout=60)
        try:
            return await anext(aiter(call))
        finally:
            call.cancel()


async def _metrics_text(runtime) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        return (await http.get(f"http://127.0.0.1:{runtime.metrics_port}/metrics")).text


async def test_a_frame_carries_the_kv_tiers_its_metrics_show(model_path, tmp_path):
    """An engine with a disk tier: each frame's tiers are its pdserve_kv_tier_* series, as
    its /metrics serves them, loads and load latency included; one without: no tiers."""
    tiered = await start_runtime(service_config("prefill", None), engine_args(
        model_path, kv_offload_dir=str(tmp_path), num_gpu_blocks_override=FILL_POOL_BLOCKS))
    plain = await start_runtime(service_config("prefill", None), engine_args(model_path))
    try:
        await asyncio.gather(tiered.wait_ready(300), plain.wait_ready(300))
        again = await fill_disk_tier(tiered)
        assert again.num_cached_tokens >= 16 * 10
        for runtime in (tiered, plain):
            await runtime.monitor.tick()

        frame = await _first_frame(tiered)
        samples = _metric_samples(await _metrics_text(tiered))
        expected = _expected_tiers(samples)
        assert _frame_tiers(frame) == expected
        # The gateway's feed (/dashboard/feed) forwards them as they are (+Inf as null).
        expected[1]["load_seconds"]["bounds"][-1] = None
        assert frame_json(frame, "a:1", "prefill")["tiers"] == expected
        memory, disk = frame.tiers
        assert (memory.tier, disk.tier) == ("memory", "disk")
        assert disk.stores >= 13 and disk.blocks == disk.stores and disk.loads > 0
        assert disk.hits == disk.loads and disk.queries >= disk.hits
        # Each disk file is the block's payload plus its header (disk_store.py).
        assert disk.bytes > disk.blocks * (memory.bytes // memory.blocks) > 0
        assert memory.hits > 0 and memory.queries >= memory.hits + disk.queries
        assert disk.load_seconds.counts[-1] == 1 and disk.load_seconds.sum > 0
        assert not memory.HasField("load_seconds") and memory.stores == memory.loads == 0

        frame = await _first_frame(plain)
        assert list(frame.tiers) == [] and frame.state.num_gpu_blocks > 0
        assert frame_json(frame, "b:1", "prefill")["tiers"] == []
        assert "pdserve_kv_tier" not in await _metrics_text(plain)
    finally:
        await asyncio.gather(tiered.stop(0.5), plain.stop(0.5))
