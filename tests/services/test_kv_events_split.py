"""KV events over the real split (issue 30): prefill and decode services with
`--kv-events-config`, a pyzmq SUB per engine, prompts sharing a prefix in a pool small enough
to evict; the hash set rebuilt from the events alone equals each engine's own."""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import pytest
import zmq

from pdserve.services.common.kv_events import external_block_hash
from pdserve.services.common.server import ServiceRuntime
from tests.services.helpers import (
    cached_hashes,
    greedy,
    run_split,
    start_cluster,
    wait_leak_free,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

BLOCK_SIZE = 16
KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": "tcp://*:0", "topic": "kv"})
"""Port 0: each engine binds a free port of its own (read back from its publisher)."""


class Subscriber:
    """What a router does: SUB to one engine, apply each batch to a set of held hashes."""

    def __init__(self, ctx: zmq.Context, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.connect("tcp://127.0.0.1:" + runtime.kv_events.endpoint.rsplit(":", 1)[1])
        self.held: set[int] = set()
        self.seqs: list[int] = []
        self.types: list[str] = []

    def apply(self, frames: list[bytes]) -> None:
        topic, seq, payload = frames
        assert topic == b"kv"
        self.seqs.append(int.from_bytes(seq, "big"))
        ts, events, rank = msgpack.unpackb(payload)
        assert rank == 0 and abs(time.time() - ts) < 120
        for event in events:
            kind = event["type"]
            self.types.append(kind)
            if kind == "BlockStored":
                assert event["medium"] == "GPU" and event["block_size"] == BLOCK_SIZE
                assert len(event["token_ids"]) == BLOCK_SIZE * len(event["block_hashes"])
                parent = event["parent_block_hash"]
                assert parent is None or parent in self.held  # the chain a router follows
                self.held.update(event["block_hashes"])
            elif kind == "BlockRemoved":
                assert event["medium"] == "GPU"
                self.held.difference_update(event["block_hashes"])
            else:
                assert event == {"type": "AllBlocksCleared"}
                self.held.clear()

    async def catch_up(self, timeout: float = 30.0) -> None:
        """Drain the engine's pending events, then read until every batch it sent is in."""
        await self.runtime.monitor.tick()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while self.sock.poll(0):
                self.apply(self.sock.recv_multipart())
            if self.runtime.kv_events._queue.empty() \
                    and len(self.seqs) == self.runtime.kv_events.num_published:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{len(self.seqs)} of {self.runtime.kv_events.num_published} "
                             "batches received")

    async def engine_hashes(self) -> set[int]:
        return {external_block_hash(h, True) for h in await cached_hashes(self.runtime)}


async def test_hash_set_from_events_equals_the_engines(model_path):
    cluster = await start_cluster(model_path, None, kv_events_config=KV_EVENTS,
                                  block_size=BLOCK_SIZE, num_gpu_blocks_override=16,
                                  max_model_len=256)
    ctx = zmq.Context()
    try:
        subs = [Subscriber(ctx, runtime) for runtime in cluster.runtimes]
        await asyncio.sleep(0.3)  # PUB drops what is sent before a subscription arrives
        prefix = list(range(1000, 1000 + 3 * BLOCK_SIZE))
        for i in range(8):  # 88 tokens: 3 shared + 2 own full blocks; 15 usable blocks
            prompt = prefix + list(range(2000 + 100 * i, 2040 + 100 * i))
            await run_split(cluster, f"kv-events-{i}", prompt, greedy(4))
        await wait_leak_free(cluster)
        for sub in subs:
            await sub.catch_up()
            assert sub.held == await sub.engine_hashes() != set()
            assert {"BlockStored", "BlockRemoved"} <= set(sub.types)  # evictions happened
        # A cleared cache, then one more request: AllBlocksCleared on the wire, then stores.
        assert await cluster.prefill.worker.engine.call(
            lambda e: e.kv_cache_manager.reset_prefix_cache())
        await run_split(cluster, "kv-events-last", prefix + [7, 8, 9], greedy(2))
        await wait_leak_free(cluster)
        for sub in subs:
            await sub.catch_up()
            assert sub.held == await sub.engine_hashes() != set()
            assert sub.seqs == list(range(len(sub.seqs)))  # none missed, in order
        assert "AllBlocksCleared" in subs[0].types
    finally:
        ctx.destroy(linger=0)
        await cluster.close()


async def test_a_busy_endpoint_fails_the_start_in_one_line(model_path):
    from pdserve.services.common.kv_events import KVEventPublisher, KVEventsConfig
    from tests.services.helpers import engine_args, service_config, start_runtime

    holder = KVEventPublisher(KVEventsConfig(True, "zmq", "tcp://*:0"))
    busy = holder.endpoint.replace("0.0.0.0", "*")
    runtime = await start_runtime(service_config("prefill", None), engine_args(
        model_path, kv_events_config={"enable_kv_cache_events": True, "endpoint": busy}))
    try:
        with pytest.raises(RuntimeError, match="--kv-events-config: cannot use tcp://"):
            await runtime.wait_ready(300)
        assert runtime.startup_error.count("\n") == 0
    finally:
        await runtime.stop(0.5)
        holder.shutdown()
