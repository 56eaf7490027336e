"""PrefixIndex against a real redis-server: registration and expiry, publishing, the
longest-prefix lookup, and behaviour while Redis is unreachable."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest_asyncio

from pdserve.services.common.prefix_index import InstanceInfo, PrefixIndex
from tests.services.helpers import free_port

H = [bytes([i]) * 16 for i in range(8)]


@pytest_asyncio.fixture
async def make_index(redis):
    """PrefixIndex factory: one key prefix per test (the cluster's instances share the
    server), any TTL."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    made: list[PrefixIndex] = []

    def make(ttl: float = 60.0) -> PrefixIndex:
        made.append(PrefixIndex(redis.url, "m", ttl=ttl, key_prefix=prefix))
        return made[-1]

    yield make
    for idx in made:
        await idx.close()


@pytest_asyncio.fixture
async def index(make_index):
    return make_index()


def _info(instance_id: str, role: str = "prefill", **kw) -> InstanceInfo:
    return InstanceInfo(instance_id, role, f"{instance_id}:1", "m", **kw)


async def test_register_is_the_heartbeat_and_registrations_expire(index, make_index):
    assert await index.register(_info("p1", num_running=3)) is True
    assert await index.register(_info("p1", num_running=4)) is False
    assert await index.register(_info("d1", role="decode")) is True
    live = await index.live_instances()
    assert {i.instance_id for i in live} == {"p1", "d1"}
    assert [i.num_running for i in live if i.instance_id == "p1"] == [4]
    assert [i.instance_id for i in await index.live_instances("decode")] == ["d1"]
    short = make_index(ttl=0.3)
    await short.register(_info("p2"))
    await short.publish("p2", H[:2], [])
    await asyncio.sleep(0.6)  # > ttl without a heartbeat: everything of p2's is gone
    assert {i.instance_id for i in await index.live_instances()} == {"p1", "d1"}
    assert await index.held_hashes("p2") == set()
    assert await short.register(_info("p2")) is True  # the owner must republish


async def test_publish_republish_and_unregister(index):
    await index.register(_info("p1"))
    assert await index.publish("p1", H[:4], [])
    assert await index.publish("p1", [H[4]], [H[1]])
    assert await index.held_hashes("p1") == {H[0], H[2], H[3], H[4]}
    assert await index.republish("p1", [H[5], H[6]])
    assert await index.held_hashes("p1") == {H[5], H[6]}
    assert await index.unregister("p1")
    assert await index.held_hashes("p1") == set()
    assert await index.live_instances() == []


async def test_the_index_records_in_which_tier_each_hash_is(index):
    """held: every hash the instance holds; held_disk: those on its disk tier only. A hash
    back in the pool leaves held_disk; a removed one leaves both."""
    await index.register(_info("p1"))
    assert await index.publish("p1", H[:4], [], on_disk=[H[2], H[3]])
    assert await index.held_hashes("p1") == set(H[:4])
    assert await index.disk_hashes("p1") == {H[2], H[3]}
    # H[0] is evicted to disk, H[2] is loaded back into the pool, H[3] dropped from disk.
    assert await index.publish("p1", [H[0], H[2]], [H[3]], on_disk=[H[0]])
    assert await index.held_hashes("p1") == {H[0], H[1], H[2]}
    assert await index.disk_hashes("p1") == {H[0]}
    assert await index.republish("p1", [H[5], H[6]], on_disk=[H[6]])
    assert await index.held_hashes("p1") == {H[5], H[6]}
    assert await index.disk_hashes("p1") == {H[6]}
    assert await index.unregister("p1")
    assert await index.disk_hashes("p1") == set()


async def test_longest_prefix_counts_leading_blocks_of_live_instances(index, make_index):
    for instance_id, held in (("a", H[:5]), ("b", [H[0], H[1], H[3]]), ("c", H[1:4])):
        await index.register(_info(instance_id))
        await index.publish(instance_id, held, [])
    short = make_index(ttl=0.3)
    await short.register(_info("dead"))
    await short.publish("dead", H, [])
    await asyncio.sleep(0.6)  # "dead" misses its heartbeat
    # c holds no first block; b stops at its gap; a holds five.
    assert await index.longest_prefix(H[:6]) == {"a": 5, "b": 2}
    assert await index.longest_prefix([]) == {}


async def test_unreachable_redis_answers_at_once_and_logs_once(caplog):
    idx = PrefixIndex(f"redis://127.0.0.1:{free_port()}/0", "m", socket_timeout=0.5,
                      max_backoff=0.2)
    caplog.set_level(logging.INFO, logger="pdserve.services.common.prefix_index")
    for _ in range(5):
        assert await idx.register(_info("p1")) is None
        assert await idx.publish("p1", H[:1], []) is False
        assert await idx.longest_prefix(H[:2]) == {}
        assert await idx.live_instances() == []
    assert not idx.is_up
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    await idx.close()


def test_instance_info_json_round_trip():
    info = _info("p1", num_running=2, num_waiting=1, kv_usage=0.25, block_size=32)
    assert InstanceInfo.from_json(info.to_json()) == info
    # Unknown fields (a newer instance) are ignored.
    assert InstanceInfo.from_json(info.to_json()[:-1] + ',"extra":1}') == info



async def test_an_engine_publishes_the_tier_of_each_hash(model_path, redis, tmp_path):
    """A prefill with a disk tier and a small pool: after its first prompt's blocks went to
    disk and came back, Redis holds every hash of the pool and the disk, and held_disk
    exactly those on disk only."""
    from tests.services.helpers import (
        FILL_POOL_BLOCKS,
        engine_args,
        fill_disk_tier,
        service_config,
        start_runtime,
    )

    runtime = await start_runtime(service_config("prefill", redis.url), engine_args(
        model_path, kv_offload_dir=str(tmp_path), num_gpu_blocks_override=FILL_POOL_BLOCKS))
    index = None
    try:
        await runtime.wait_ready(300)
        index = PrefixIndex(redis.url, runtime.worker.model_name)
        await fill_disk_tier(runtime)
        await runtime.monitor.flush()
        pool, disk = await runtime.worker.engine.call(lambda e: (
            set(e.kv_cache_manager.block_pool.cached_block_hash_to_block),
            set(e.kv_offloader.store.hashes())))
        instance_id = runtime.identity.instance_id
        assert disk - pool, "some blocks must be on disk only"
        assert await index.held_hashes(instance_id) == pool | disk
        assert await index.disk_hashes(instance_id) == disk - pool
    finally:
        if index is not None:
            await index.close()
        await runtime.stop(0.5)
