"""InstanceMonitor: polls the engine, feeds the metrics, keeps the Redis prefix index current.

Every `publish_interval` one engine-thread op drains the KV cache events (BlockStored /
BlockRemoved / AllBlocksCleared) and snapshots the stats; the events' net effect is
published to this instance's held set. Every `heartbeat_interval` the registration is
refreshed, by a task of its own that never waits for the engine thread (a tick does, as long
as the step in flight takes: seconds for a long prefill, past the registration's TTL on a
loaded machine). When Redis was unreachable (events were dropped) or lost our keys (restart,
TTL lapsed) the next tick republishes the whole hash map, snapshotted on the engine thread
together with the event drain so that nothing falls between the two. The `pdserve_redis_up`
gauge follows the index's connection state after every tick and heartbeat.

`leave()` (a draining instance) drops the registration and the held set at once and stops
writing to Redis, so every gateway stops routing here within its registry cache (1 s),
while the metrics keep following the requests that finish.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.services.common.metrics import EngineStats
from pdserve.services.common.worker import EngineWorker, stats_op
from pdserve.shared.kv_cache.block_pool import BlockStored, KVCacheEvent
from pdserve.shared.prefix_index import InstanceInfo, PrefixIndex

logger = logging.getLogger(__name__)


def net_changes(events: list[KVCacheEvent]) -> tuple[list[bytes], list[bytes]]:
    """(added, removed): each hash's state after the last event that names it."""
    state: dict[bytes, bool] = {}
    for event in events:
        stored = isinstance(event, BlockStored)
        for block_hash in event.block_hashes:
            state[block_hash] = stored
    return ([h for h, held in state.items() if held],
            [h for h, held in state.items() if not held])


class InstanceMonitor:
    def __init__(self, worker: EngineWorker, index: PrefixIndex | None,
                 metrics_address: str = "") -> None:
        """`metrics_address`: host:port of the instance's /metrics, registered with it."""
        self.worker = worker
        self.index = index
        self.metrics_address = metrics_address
        self.config = worker.config
        self.stats: EngineStats | None = None
        self.dirty = True
        """Redis may not match our cache: republish everything at the next chance."""
        self._tasks: list[asyncio.Task] = []
        self._lock = asyncio.Lock()
        """Serializes ticks, resyncs and leave() (held while a tick waits for the engine)."""
        self._register_lock = asyncio.Lock()
        """Serializes heartbeats with leave() (never held across an engine op)."""
        self._left = False
        """leave() was called: nothing more is written to Redis."""

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run()), loop.create_task(self._beat())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.leave()

    async def leave(self) -> None:
        """Unregister now and for good (idempotent); the engine's metrics keep updating.
        Should Redis not answer, the registration expires within its TTL all the same."""
        if self.index is None or self._left:
            return
        async with self._lock, self._register_lock:
            self._left = True
            if await self.index.unregister(self.worker.identity.instance_id):
                logger.info("%s left the registry", self.worker.identity.instance_id)

    def info(self) -> InstanceInfo:
        w, s = self.worker, self.stats
        return InstanceInfo(
            instance_id=w.identity.instance_id, role=w.role, address=w.identity.address,
            model=w.model_name, num_running=s.num_running if s else 0,
            num_waiting=s.num_waiting if s else 0,
            kv_usage=round(s.kv_cache_usage, 4) if s else 0.0, block_size=w.block_size,
            metrics_address=self.metrics_address)

    async def _run(self) -> None:
        await self._every(self.config.publish_interval, self.tick, "tick")

    async def _beat(self) -> None:
        await self._every(self.config.heartbeat_interval, self.heartbeat, "heartbeat")

    async def _every(self, interval: float, fn, what: str) -> None:
        while True:
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let monitoring take the service down
                logger.exception("instance monitor %s failed", what)
            await asyncio.sleep(interval)

    async def tick(self) -> None:
        """Drain events, update metrics, publish the net changes."""
        async with self._lock:
            events, self.stats, after_abort = await self.worker.engine.call(
                lambda e: (e.kv_cache_manager.take_events(), stats_op(e),
                           e.num_prompt_tokens_after_abort))
            self.worker.metrics.update_engine(self.stats, self.worker.num_pinned_blocks())
            self.worker.metrics.prompt_tokens_after_abort(after_abort)
            if self.index is None or self._left:
                return
            try:
                if self.dirty:
                    await self._resync()
                    return
                added, removed = net_changes(events)
                if not await self.index.publish(self.worker.identity.instance_id, added,
                                                removed):
                    self.dirty = True
            finally:
                self.worker.metrics.redis_up(self.index.is_up)

    async def heartbeat(self) -> None:
        """Refresh the registration (no engine op); when it was new (Redis restarted, the
        TTL lapsed) or Redis did not answer, the next tick republishes the hashes."""
        if self.index is None:
            return
        async with self._register_lock:
            if self._left:
                return
            is_new = await self.index.register(self.info())
        if is_new is None or is_new:
            self.dirty = True
        self.worker.metrics.redis_up(self.index.is_up)

    async def flush(self) -> None:
        """Publish everything pending now (tests, shutdown)."""
        await self.tick()
        if self.dirty:
            await self.tick()  # a resync

    async def _resync(self) -> None:
        assert self.index is not None
        instance_id = self.worker.identity.instance_id
        if await self.index.register(self.info()) is None:
            return
        hashes = await self.worker.engine.call(snapshot_hashes_op)
        if await self.index.republish(instance_id, hashes):
            if self.dirty:
                logger.info("prefix index: republished %d block hashes of %s", len(hashes),
                            instance_id)
            self.dirty = False


def snapshot_hashes_op(engine) -> list[bytes]:
    """Every hash cached in the pool; drops the pending events (the snapshot covers them)."""
    kv = engine.kv_cache_manager
    kv.take_events()
    return list(kv.block_pool.cached_block_hash_to_block)
