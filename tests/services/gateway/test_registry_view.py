"""RegistryView against a real redis-server of its own (frozen, killed and restarted here):
it mirrors the instances and their held sets, copies a held set only when it changed,
answers from memory while Redis is frozen or gone, and keeps the instances a restarted
(empty) Redis lost until they register again."""

from __future__ import annotations

import os
import shutil
import signal
import uuid

import pytest
import pytest_asyncio

from pdserve.services.common.prefix_index import InstanceInfo, PrefixIndex
from pdserve.services.gateway.registry_view import RegistryView
from tests.services.helpers import RedisServer

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed")

H = [bytes([i]) * 16 for i in range(8)]


def _info(instance_id: str, role: str) -> InstanceInfo:
    return InstanceInfo(instance_id, role, f"{instance_id}:1", "m")


@pytest.fixture
def own_redis():
    server = RedisServer()
    server.start()
    yield server
    if server._proc is not None:
        os.kill(server._proc.pid, signal.SIGCONT)
    server.stop()


@pytest_asyncio.fixture
async def indexes(own_redis):
    """(an instance's index, the gateway's view) on one key prefix."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    instance = PrefixIndex(own_redis.url, "m", ttl=60, key_prefix=prefix, max_backoff=0.1)
    view = RegistryView(PrefixIndex(own_redis.url, "m", ttl=60, key_prefix=prefix,
                                    socket_timeout=0.3, max_backoff=0.1),
                        interval=3600, keep_after_restart=60)
    yield instance, view
    await instance.close()
    await view.close()


async def test_the_view_mirrors_instances_and_held_sets(indexes):
    instance, view = indexes
    assert await instance.register(_info("p0", "prefill"))
    assert await instance.register(_info("d0", "decode"))
    assert await instance.publish("p0", H[:4], [])
    assert await instance.publish("d0", H[:2], [])
    assert await view.refresh()
    assert [i.instance_id for i in await view.live_instances("decode")] == ["d0"]
    assert {i.instance_id for i in await view.live_instances()} == {"p0", "d0"}
    assert await view.longest_prefix(H[:6]) == {"p0": 4, "d0": 2}
    assert await view.longest_prefix([H[5], *H[:4]]) == {}  # the first block: nobody
    # What the index itself answers, one lookup in Redis: the same.
    assert await instance.longest_prefix(H[:6]) == {"p0": 4, "d0": 2}

    snapshot = await view.index.snapshot({"p0": view._listed["p0"].generation})
    held = {listed.info.instance_id: listed.held for listed in snapshot.instances}
    assert held == {"p0": None, "d0": frozenset(H[:2])}  # p0 unchanged: not copied again

    assert await instance.publish("p0", [], [H[2]])
    assert await instance.unregister("d0")
    assert await view.refresh()
    assert await view.longest_prefix(H[:6]) == {"p0": 2}
    assert [i.instance_id for i in await view.live_instances()] == ["p0"]


async def test_a_frozen_redis_leaves_the_last_view_answering(indexes, own_redis):
    instance, view = indexes
    assert await instance.register(_info("d0", "decode"))
    assert await instance.publish("d0", H[:3], [])
    assert await view.refresh() and view.is_up
    os.kill(own_redis._proc.pid, signal.SIGSTOP)
    try:
        assert not await view.refresh()  # the socket timeout: no answer
        assert not view.is_up and view.age is not None
        assert [i.instance_id for i in await view.live_instances()] == ["d0"]
        assert await view.longest_prefix(H[:4]) == {"d0": 3}
    finally:
        os.kill(own_redis._proc.pid, signal.SIGCONT)


async def test_instances_a_restarted_redis_lost_stay_until_they_register(indexes, own_redis):
    instance, view = indexes
    for name, role in (("p0", "prefill"), ("d0", "decode")):
        assert await instance.register(_info(name, role))
    assert await instance.publish("d0", H[:3], [])
    assert await view.refresh()
    own_redis.stop()
    assert not await view.refresh()
    assert {i.instance_id for i in await view.live_instances()} == {"p0", "d0"}
    own_redis.start()  # same port, empty, a new run id
    view.index._retry_at = instance._retry_at = 0.0  # no backoff wait in a test
    assert await view.refresh() and view.is_up
    # Kept (Redis lists nothing), with their cached prefixes, for keep_after_restart.
    assert {i.instance_id for i in await view.live_instances()} == {"p0", "d0"}
    assert await view.longest_prefix(H[:4]) == {"d0": 3}
    assert await instance.register(_info("d0", "decode"))  # d0's heartbeat comes back
    assert await instance.republish("d0", H[:2])
    assert await view.refresh()
    assert await view.longest_prefix(H[:4]) == {"d0": 2}
    view._keep_until = 0.0  # the grace ends: p0 never came back
    assert await view.refresh()
    assert [i.instance_id for i in await view.live_instances()] == ["d0"]
