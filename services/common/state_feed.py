"""StateFeed: a live view of one instance's block pool and requests (the dashboard's source).

    WatchState ─▶ StateFeed.watch() ─▶ frames: one snapshot, then deltas, every `interval`
                      │
                      └─ one ticker per instance, however many watchers:
                         loop side: pins and transfers (the KV connector's)
                         engine thread (one op): changed block ids + their states, the
                           scheduler's request_views() and block_holders(), stats_op (the
                           leak audit's counts)

Each block is one byte (the proto's StateFrame comment):

    bits 0-1  0 free   1 in use   2 pinned for a KV transfer   3 the null block
    bit 2     cached (holds a block hash; a free cached block is evictable)

The counts over the map equal each frame's `state` (an EngineState built exactly as
GetState builds it): free = state 0, used = states 1 and 2, pinned = state 2, cached =
bit 2. They are one moment: the pin set is read on the loop and the op submitted with no
await between, so every pin in the set is still unreleased when the op runs (its free is
queued behind it on the engine thread).

The first frame to a watcher is a snapshot (the whole map, one byte per block: 100,000
blocks are 100 KB); the rest are deltas against the frame before (the block pool's
change tracking, on while someone watches). A watcher that falls more than MAX_BACKLOG
frames behind gets a fresh snapshot instead of the frames it missed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.services.common.metrics import EngineStats
from pdserve.services.common.tier_metrics import TierView
from pdserve.shared.request import RequestStatus

logger = logging.getLogger(__name__)

BLOCK_FREE, BLOCK_USED, BLOCK_PINNED, BLOCK_NULL = 0, 1, 2, 3
BLOCK_CACHED = 4
"""Flag bit: the block holds a block hash."""
STATE_MASK = 3
DEFAULT_INTERVAL_S = 0.25
MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 5.0
MAX_BACKLOG = 16
"""Frames a watcher may have unread before it is resynced with a snapshot."""


class RequestView(NamedTuple):
    request_id: str
    status: str
    """running | waiting | preempted | paused (decode) | pinned (prefill: finished, held for
    a FetchKV) | transfer (decode: blocks a receive writes) | held (none of these: a leak)"""
    block_ids: list[int]
    num_cached_tokens: int
    num_computed_tokens: int
    num_prompt_tokens: int
    num_tokens: int
    lora_name: str = ""
    """The request's LoRA adapter ("": the base model)."""


class TransferView(NamedTuple):
    request_id: str
    direction: str
    """send (prefill) | receive (decode)"""
    peer: str
    num_blocks: int
    seconds: float


class HistogramView(NamedTuple):
    bounds: list[float]
    counts: list[int]
    """Cumulative, one per bound (+Inf last)."""
    sum: float


class FeedSample(NamedTuple):
    """What one engine-thread op returns (feed_op)."""

    block_states: bytes | None
    """The whole pool (no pinned overlay) when a full sample was asked for, else None."""
    changed_block_ids: list[int]
    changed_states: bytes
    stats: EngineStats
    requests: list[RequestView]


class LoopSide(NamedTuple):
    """The KV connector's view, read on the event loop right before the op."""

    pinned_block_ids: frozenset[int]
    transfers: list[TransferView]


class Counters(NamedTuple):
    prompt_tokens: int
    generation_tokens: int
    ttft: HistogramView | None
    itl: HistogramView | None
    tiers: list[TierView] = []
    """The KV tiers' series (tier_metrics.tier_views); none without a disk tier."""


class StateFrame(NamedTuple):
    seq: int
    snapshot: bool
    block_states: bytes
    """Snapshot: the whole map; delta: one byte per `changed_block_ids` entry."""
    changed_block_ids: list[int]
    state: object
    """pdserve.services.common.worker.EngineState of this moment."""
    requests: list[RequestView]
    transfers: list[TransferView]
    stats: EngineStats
    counters: Counters
    time: float


_STATUS = {RequestStatus.RUNNING: "running", RequestStatus.PREEMPTED: "preempted",
           RequestStatus.PAUSED: "paused"}
"""RequestView.status of a scheduler's request by its RequestStatus ("waiting" otherwise)."""
_TRANSFER_STATUS = {"send": "pinned", "receive": "transfer"}
"""RequestView.status of a request a KV transfer holds, by its `kv_transfer`."""


def block_state(block) -> int:
    """The map byte of a KVCacheBlock, pins aside."""
    return (BLOCK_USED if block.ref_cnt > 0 else BLOCK_FREE) | (
        BLOCK_CACHED if block.block_hash is not None else 0)


def feed_op(engine, full: bool, stats_op: Callable) -> FeedSample:
    """On the engine thread: the pool's map (full) or its changes since the last call, the
    requests' block tables and `stats_op(engine)`, all of one moment. `full` (re)starts the
    pool's change tracking."""
    pool = engine.kv_cache_manager.block_pool
    block_states: bytes | None = None
    changed: list[int] = []
    if full:
        pool.track_changes(True)
        block_states = bytes([BLOCK_NULL, *(block_state(b) for b in pool.blocks[1:])])
    else:
        changed = pool.take_changed_block_ids()
    changed_states = bytes(block_state(pool.blocks[i]) for i in changed)
    scheduler = engine.scheduler
    views = scheduler.request_views()
    requests = [RequestView(v.request_id, _TRANSFER_STATUS.get(v.kv_transfer)
                            or _STATUS.get(v.status, "waiting"), list(v.block_ids),
                            max(v.num_cached_tokens, 0), v.num_computed_tokens,
                            v.num_prompt_tokens, v.num_tokens,
                            v.lora_request.lora_name if v.lora_request is not None else "")
                for v in views]
    requests += [RequestView(request_id, "held", list(block_ids), 0, 0, 0, 0)
                 for request_id, block_ids in unowned(views, scheduler.block_holders())]
    return FeedSample(block_states, changed, changed_states, stats_op(engine), requests)


def unowned(views: Iterable, holders: Mapping[str, tuple[int, ...]]) -> list[tuple]:
    """(request id, block ids) of each block holder (`Scheduler.block_holders`) that none of
    the scheduler's `views` is: blocks nothing owns (a leak), sorted by id."""
    owned = {v.request_id for v in views}
    return sorted((rid, ids) for rid, ids in holders.items() if rid not in owned)


@dataclass(slots=True, eq=False)  # hashed by identity: a dict key
class _Watcher:
    frames: deque[StateFrame] = field(default_factory=deque)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    resync: bool = True
    """The next frame it gets is a snapshot of the current map."""


class StateFeed:
    """One instance's feed: a ticker running while anyone watches, fanned out to watchers.

    Args:
        sample: runs `feed_op(engine, full, ...)` on the engine thread (the worker's
            `engine.call`), returning a FeedSample.
        loop_side: the worker's bookkeeping of this moment (called synchronously, right
            before `sample` is submitted).
        make_state: (stats, num_pinned_blocks) -> the EngineState of this moment.
        counters: the instance's cumulative token counters, latency histograms and KV
            tiers.
    """

    def __init__(self, sample: Callable[[bool], Awaitable[FeedSample]],
                 loop_side: Callable[[], LoopSide], make_state: Callable[..., object],
                 counters: Callable[[], Counters], stop_tracking: Callable[[], Awaitable]):
        self._sample = sample
        self._loop_side = loop_side
        self._make_state = make_state
        self._counters = counters
        self._stop_tracking = stop_tracking
        self._watchers: dict[_Watcher, float] = {}
        """watcher -> the interval it asked for."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False
        self.seq = 0
        self._map: bytearray | None = None
        """The map as of frame `seq` (pins included)."""
        self._pool_map: bytearray | None = None
        """The pool's own states as of frame `seq` (no pins)."""
        self._pinned: frozenset[int] = frozenset()
        self._last: StateFrame | None = None

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    async def watch(self, interval: float = DEFAULT_INTERVAL_S) -> AsyncIterator[StateFrame]:
        """A snapshot, then a delta every `interval` s (clamped to [0.05, 5]) until the
        consumer stops or the feed closes."""
        if self._closed:
            return
        interval = min(max(interval or DEFAULT_INTERVAL_S, MIN_INTERVAL_S), MAX_INTERVAL_S)
        w = _Watcher()
        self._watchers[w] = interval
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()
        try:
            while not self._closed:
                await w.event.wait()
                w.event.clear()
                if self._closed:
                    return
                if w.resync:
                    w.resync = False
                    w.frames.clear()
                    yield self._snapshot()
                while w.frames and not w.resync:
                    yield w.frames.popleft()
        finally:
            self._watchers.pop(w, None)

    def close(self) -> None:
        """End every watch stream and the ticker."""
        self._closed = True
        for w in self._watchers:
            w.event.set()
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        self.close()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    # -- ticker --------------------------------------------------------------------------

    async def _run(self) -> None:
        full = True
        while not self._closed:
            if not self._watchers:
                if not full:  # nobody watches: stop the pool's change tracking
                    await self._stop_tracking()
                    full = True
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.monotonic()
            try:
                self._publish(await self._tick(full))
                full = False
            except Exception:  # never let the feed take the service down
                logger.exception("state feed tick failed; resyncing")
                full = True
                await asyncio.sleep(1.0)
                continue
            interval = min(self._watchers.values(), default=DEFAULT_INTERVAL_S)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _tick(self, full: bool) -> StateFrame:
        # NOTE: no await between reading the loop side and submitting the op (see module).
        side = self._loop_side()
        sample = await self._sample(full)
        counters = self._counters()
        seq = self.seq + 1
        pinned = side.pinned_block_ids
        if full:
            assert sample.block_states is not None
            pool_map, map_ = bytearray(sample.block_states), bytearray(sample.block_states)
            self._pool_map, self._map = pool_map, map_
            touched: Iterable[int] = pinned
        else:
            assert self._pool_map is not None and self._map is not None
            pool_map, map_ = self._pool_map, self._map
            for i, s in zip(sample.changed_block_ids, sample.changed_states):
                pool_map[i] = s
            touched = set(sample.changed_block_ids) | (pinned ^ self._pinned)
        for i in touched:
            map_[i] = (pool_map[i] & ~STATE_MASK) | BLOCK_PINNED if i in pinned else pool_map[i]
        # Only what differs from the previous frame travels (a snapshot: the whole map).
        changed = [] if full else sorted(touched)
        states = bytes(map_) if full else bytes(map_[i] for i in changed)
        self._pinned = pinned
        state = self._make_state(sample.stats, len(pinned))
        return StateFrame(seq, full, states, changed, state,
                          sample.requests, side.transfers, sample.stats, counters, time.time())

    def _publish(self, frame: StateFrame) -> None:
        self.seq = frame.seq
        self._last = frame
        for w in self._watchers:
            # A watcher already due a resync gets the whole map next, not this frame.
            if not w.resync:
                if frame.snapshot or len(w.frames) >= MAX_BACKLOG:
                    w.resync = True  # a new map (or a watcher too far behind): send it whole
                else:
                    w.frames.append(frame)
            w.event.set()

    def _snapshot(self) -> StateFrame:
        """The current map whole, with the last frame's other fields."""
        last = self._last
        assert last is not None and self._map is not None
        return last._replace(snapshot=True, block_states=bytes(self._map), changed_block_ids=[])


def count_states(block_map: bytes | bytearray) -> dict[str, int]:
    """The leak audit's counts over a map: free, used, pinned, cached (null block aside)."""
    counts = [0] * 8
    for s in block_map[1:]:
        counts[s] += 1
    free = counts[BLOCK_FREE] + counts[BLOCK_FREE | BLOCK_CACHED]
    pinned = counts[BLOCK_PINNED] + counts[BLOCK_PINNED | BLOCK_CACHED]
    used = counts[BLOCK_USED] + counts[BLOCK_USED | BLOCK_CACHED] + pinned
    cached = sum(counts[s | BLOCK_CACHED] for s in range(4))
    return {"num_free_blocks": free, "num_used_blocks": used, "num_pinned_blocks": pinned,
            "num_cached_blocks": cached}
