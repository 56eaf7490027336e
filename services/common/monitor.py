"""InstanceMonitor: polls the engine, feeds the metrics, keeps the Redis prefix index current.

    tick (every publish_interval)   one engine-thread op: drain the KV cache events
        │                           (BlockStored / BlockRemoved / AllBlocksCleared), snapshot
        │                           the stats; their net effect joins the pending changes
        ▼                           (at most MAX_PENDING_HASHES: past it they are dropped)
    writer task                     sends them to Redis: publish the pending changes, or, when
                                    dirty, register + republish the whole hash map
    heartbeat (heartbeat_interval)  refreshes the registration; a new one (Redis restarted,
                                    TTL lapsed) or no answer makes the index dirty

Every drained event also goes, as drained, to the KV events publisher when
`--kv-events-config` asks for one (services/common/kv_events.py): Redis or not, the ZMQ
stream sees every event once, in order.

Nothing here waits on Redis in the engine's or a request's path: the tick hands its changes
to the writer and returns, and a Redis that is slow or gone costs dropped writes (counted in
`pdserve_prefix_index_writes_dropped_total`), never a step. Dropped changes (overflow, or a
publish Redis did not take) make the index dirty: the next write republishes the whole hash
map, snapshotted on the engine thread together with the event drain so that nothing falls
between the two. The heartbeat is a task of its own that never waits for the engine thread
(a tick does, as long as the step in flight takes: seconds for a long prefill, past the
registration's TTL on a loaded machine). The `pdserve_redis_up` gauge follows the index's
connection state after every write and heartbeat.

`leave()` (a draining instance) drops the registration and the held set at once and stops
writing to Redis, so every gateway stops routing here within its registry refresh (1 s),
while the metrics keep following the requests that finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from pdserve.services.common.kv_events import KVEventPublisher
from pdserve.services.common.lora import lora_stats_op
from pdserve.services.common.metrics import EngineStats
from pdserve.services.common.prefix_index import InstanceInfo, PrefixIndex
from pdserve.services.common.worker import EngineWorker, stats_op, tier_snapshot_op
from pdserve.shared.kv_cache.block_pool import KVCacheEvent

logger = logging.getLogger(__name__)

MAX_PENDING_HASHES = 65536
"""Block-hash changes waiting for Redis, at most: past it they are dropped (and counted) and
the next write republishes the whole hash map instead."""


class InstanceMonitor:
    def __init__(self, worker: EngineWorker, index: PrefixIndex | None,
                 metrics_address: str = "", kv_events: KVEventPublisher | None = None) -> None:
        """`metrics_address`: host:port of the instance's /metrics, registered with it;
        `kv_events`: where every drained event batch is also published (None: nowhere)."""
        self.worker = worker
        self.kv_events = kv_events
        self.index = index
        self.metrics_address = metrics_address
        self.config = worker.config
        self.stats: EngineStats | None = None
        self.dirty = True
        """Redis may not match our cache: republish everything at the next chance."""
        self._pending: dict[bytes, str | None] = {}
        """Net changes not yet written: block hash -> the tier holding it ("memory", "disk") or
        None (removed)."""
        self._wake = asyncio.Event()
        """Set when there is something for the writer task to do."""
        self._tasks: list[asyncio.Task] = []
        self._lock = asyncio.Lock()
        """Serializes ticks with the resync's snapshot (held while a tick waits for the
        engine, never across a Redis call)."""
        self._write_lock = asyncio.Lock()
        """Serializes writes to Redis with leave()."""
        self._register_lock = asyncio.Lock()
        """Serializes heartbeats with leave() (never held across an engine op)."""
        self._left = False
        """leave() was called: nothing more is written to Redis."""

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._every(self.config.publish_interval, self.tick, "tick")),
            loop.create_task(self._every(self.config.heartbeat_interval, self.heartbeat,
                                         "heartbeat")),
            loop.create_task(self._write_forever())]

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
        async with self._write_lock, self._register_lock:
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
            metrics_address=self.metrics_address,
            kv_block_bytes=w.layout.bytes_per_block,
            lora_adapters=tuple(dataclasses.asdict(a) for a in w.lora.listed()))

    async def _every(self, interval: float, fn, what: str) -> None:
        while True:
            try:
                await fn()
            except Exception:  # never let monitoring take the service down
                logger.exception("instance monitor %s failed", what)
            await asyncio.sleep(interval)

    async def tick(self) -> None:
        """Drain events, update metrics, queue the net changes for the writer
        (never waits on Redis)."""
        async with self._lock:
            events, self.stats, after_abort, unreachable, lora, tiers = \
                await self.worker.engine.call(
                    lambda e: (take_kv_events_op(e), stats_op(e),
                               e.num_prompt_tokens_after_abort,
                               (e.num_ttft_unreachable, e.num_ttft_rejected), lora_stats_op(e),
                               tier_snapshot_op(e)))
            self.worker.metrics.update_engine(self.stats, self.worker.num_pinned_blocks())
            if tiers is not None:
                self.worker.metrics.kv_tiers(tiers)
            if lora is not None:
                self.worker.metrics.lora_info(*lora)
            self.worker.metrics.prompt_tokens_after_abort(after_abort)
            self.worker.metrics.slo_ttft_unreachable(*unreachable)
            events, held = events
            if self.kv_events is not None:
                self.kv_events.publish(events)
            if self.index is None or self._left:
                return
            self._queue(held)

    def _queue(self, held: dict[bytes, str | None]) -> None:
        """Queue each changed hash's state now (the tier of this instance holding it)."""
        if not self.dirty:  # else the resync's snapshot covers these events
            self._pending.update(held)
            if len(self._pending) > MAX_PENDING_HASHES:
                self._drop(len(self._pending), "Redis is slow")
        if self.dirty or self._pending:
            self._wake.set()

    def _drop(self, num_hashes: int, why: str) -> None:
        """Forget the pending changes (counted): the next write republishes everything."""
        if num_hashes:
            logger.warning("prefix index: %d block-hash changes dropped (%s); republishing "
                           "the whole hash map at the next write", num_hashes, why)
            self.worker.metrics.index_writes_dropped(num_hashes)
        self._pending = {}
        self.dirty = True

    async def _write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.write()
            except Exception:  # never let monitoring take the service down
                logger.exception("instance monitor write failed")

    async def write(self) -> None:
        """Send what is pending to Redis: the whole hash map when dirty, else the net
        changes (a publish Redis does not take is dropped: the index turns dirty)."""
        if self.index is None:
            return
        async with self._write_lock:
            if self._left:
                return
            try:
                if self.dirty:
                    await self._resync()
                elif self._pending:
                    pending, self._pending = self._pending, {}
                    if not await self.index.publish(
                            self.worker.identity.instance_id,
                            [h for h, tier in pending.items() if tier],
                            [h for h, tier in pending.items() if not tier],
                            [h for h, tier in pending.items() if tier == "disk"]):
                        self._drop(len(pending) + len(self._pending), "Redis did not take them")
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
            self._wake.set()
        self.worker.metrics.redis_up(self.index.is_up)

    async def flush(self) -> None:
        """Publish everything pending now (tests, shutdown)."""
        await self.tick()
        await self.write()
        if self.dirty:
            await self.write()  # a resync

    async def _resync(self) -> None:
        assert self.index is not None
        instance_id = self.worker.identity.instance_id
        if await self.index.register(self.info()) is None:
            return
        async with self._lock:  # no tick between the snapshot and the pending changes
            hashes, on_disk, events = await self.worker.engine.call(snapshot_hashes_op)
            if self.kv_events is not None:
                self.kv_events.publish(events)
            self._pending = {}
            self.dirty = False
        if await self.index.republish(instance_id, hashes, on_disk):
            logger.info("prefix index: republished %d block hashes of %s", len(hashes),
                        instance_id)
        else:
            self.dirty = True


def take_kv_events_op(engine) -> tuple[list[KVCacheEvent], dict[bytes, str | None]]:
    """The pool's KV events, then the disk tier's, since the last drain; and for each hash
    they name, the tier this instance holds it in now: "memory" (the pool), "disk" (the
    disk tier only) or None (neither). The Redis index records both tiers: a block moved
    from the pool to disk is still this instance's."""
    kv, off = engine.kv_cache_manager, engine.kv_offloader
    events = kv.take_events()
    if off is not None:
        events += off.take_events()
    cached = kv.block_pool.cached_block_hash_to_block
    disk = off.store if off is not None else ()
    return events, {h: "memory" if h in cached else "disk" if h in disk else None
                    for e in events for h in e.block_hashes}


def snapshot_hashes_op(engine) -> tuple[list[bytes], list[bytes], list[KVCacheEvent]]:
    """Every hash this instance holds (pool and disk tier), those of them on disk only,
    and the pending events it drains: the snapshot covers them for Redis, the KV events
    publisher still sends them."""
    events, _ = take_kv_events_op(engine)
    cached = engine.kv_cache_manager.block_pool.cached_block_hash_to_block
    on_disk = [] if engine.kv_offloader is None else [
        h for h in engine.kv_offloader.store.hashes() if h not in cached]
    return list(cached) + on_disk, on_disk, events
