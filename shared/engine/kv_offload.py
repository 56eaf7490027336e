"""KVOffloader: moves KV blocks between the paged pool and the disk tier, off the engine's step.

    evict (engine thread, inside BlockPool.get_new_blocks, before the block is reused)
        └─ on_evict: index_select the blocks' K and V of every layer into one buffer
           ──▶ writer thread: one file per block (DiskBlockStore.put)
    load (engine thread, at admission: KVTransferTracker.start_load)
        └─ load(): blocks allocated, not yet cached ──▶ loader thread: read + verify each
           block into a host buffer (DiskBlockStore.get_into) ──▶ take_finished (engine
           thread, next schedule): index_copy_ into the pool, report the count

The engine thread does only the copies (2 x num_layers index_select / index_copy_ calls per
batch of blocks, no Python per block); the I/O threads make no torch call (file reads,
writes and checksums release the GIL; a second OpenMP team would make the engine's workers
sleep between regions: engine_core.apply_cpu_placement's NOTE), and no other thread ever
writes the pool.

A block already on disk is not written again. Loads never serve a bad block: the loader
stops at the first block the store does not answer (missing, truncated, corrupt), and
reports how many leading blocks it read; the scheduler recomputes the rest.

Source: vLLM's KV offloading connector (CPU tier, v0.11) and LMCache's local disk backend
keep evicted or finished blocks in a slower tier the same way; this is pdserve's own.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pdserve.shared.kv_cache.block_pool import (
    MEDIUM_DISK,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from pdserve.shared.kv_cache.disk_store import DiskBlockStore, kv_identity
from pdserve.shared.kv_cache.prefix_hash import BlockHash

logger = logging.getLogger(__name__)

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
MAX_PENDING_WRITES = 4096
"""Evicted blocks waiting for the writer; past this, evictions are not kept (counted)."""
SHUTDOWN_WRITE_S = 6.0
"""How long shutdown spends writing the pool's cached blocks to disk (the service bounds
the whole engine shutdown at 10 s)."""


@dataclass(slots=True)
class OffloadStats:
    """Cumulative counters of the tiers, in blocks (monotonic, for Prometheus counters)."""

    memory_queries: int = 0
    """Full blocks looked up in the pool at admission (those the prompt could hit)."""
    memory_hits: int = 0
    disk_queries: int = 0
    """Blocks looked up on disk: those past the pool's hits."""
    disk_hits: int = 0
    """Blocks found on disk at admission, past the pool's hits."""
    writes_dropped: int = 0
    """Evicted blocks not kept because the writer was behind."""
    load_seconds: list[float] = field(default_factory=list)
    """Durations of finished loads since the last `take_load_seconds` (seconds)."""

    def count_lookup(self, max_blocks: int, num_pool_hits: int, num_disk_hits: int) -> None:
        """One request's first lookup: `max_blocks` full blocks it could hit, found
        `num_pool_hits` in the pool, then `num_disk_hits` on disk."""
        self.memory_queries += max_blocks
        self.memory_hits += num_pool_hits
        self.disk_queries += max_blocks - num_pool_hits
        self.disk_hits += num_disk_hits


class TierSnapshot(NamedTuple):
    """The tiers of one engine at one moment: per tier ("memory": the pool's cached
    blocks, "disk"), blocks and bytes held (gauges), blocks looked up at admission and
    found (cumulative); the disk tier's cumulative block counts; load durations (s)."""

    blocks: dict[str, int]
    bytes: dict[str, int]
    queries: dict[str, int]
    hits: dict[str, int]
    stores: int
    loads: int
    store_failures: int
    load_failures: int
    evictions: int
    writes_dropped: int
    load_seconds: tuple[float, ...]


class KVOffloader:
    """The disk tier's traffic for one engine: evicted blocks out, admitted prefixes in.

    Args:
        store: the engine's disk tier.
        kv_caches: the pool, per layer (k_cache, v_cache), each
            [num_blocks, block_size, num_kv_heads, head_dim], any dtype and device.
    """

    def __init__(self, store: DiskBlockStore, kv_caches: KVCaches):
        self.store = store
        self.kv_caches = kv_caches
        k = kv_caches[0][0]
        self.block_shape = (len(kv_caches), 2, *k.shape[1:])
        """One block's payload: [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]."""
        self.dtype = k.dtype
        self.stats = OffloadStats()
        self.block_pool: BlockPool | None = None
        """The pool whose evictions come here (`make_offloader` sets it): its cached blocks
        are written at shutdown."""
        self._pending: set[BlockHash] = set()
        """Hashes queued for the writer (not re-queued by another eviction)."""
        self._finished: dict[str, tuple[int, torch.Tensor | None, list[int]]] = {}
        """request_id -> (blocks loaded, their host buffer, block ids), for loads that ended
        (copied into the pool and reported by take_finished)."""
        self._lock = threading.Lock()
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._loads: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, args=(q, fn), name=name,
                                          daemon=True)
                         for q, fn, name in ((self._writes, self._write, "kv-offload-write"),
                                             (self._loads, self._load, "kv-offload-load"))]
        for t in self._threads:
            t.start()

    # -- engine thread ----------------------------------------------------------------------

    def on_evict(self, block_ids: list[int], block_hashes: list[BlockHash]) -> None:
        """Copy the KV of cached blocks the pool is evicting (before anything overwrites
        them) and queue it for the disk. Blocks already on disk or queued are skipped."""
        store, pending = self.store, self._pending
        keep = [i for i, h in enumerate(block_hashes) if h not in store and h not in pending]
        if not keep:
            return
        room = MAX_PENDING_WRITES - len(pending)
        if len(keep) > room:
            self.stats.writes_dropped += len(keep) - max(room, 0)
            keep = keep[:max(room, 0)]
            if not keep:
                return
        device = self.kv_caches[0][0].device
        ids = torch.tensor([block_ids[i] for i in keep], dtype=torch.long, device=device)
        num_layers, _, *rest = self.block_shape
        buf = torch.empty((num_layers, 2, len(keep), *rest), dtype=self.dtype, device=device)
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            torch.index_select(k_cache, 0, ids, out=buf[layer, 0])
            torch.index_select(v_cache, 0, ids, out=buf[layer, 1])
        hashes = [block_hashes[i] for i in keep]
        with self._lock:
            pending.update(hashes)
        self._writes.put((hashes, buf))

    def load(self, request_id: str, block_hashes: list[BlockHash], block_ids: list[int]) -> None:
        """Start reading `block_hashes` from disk into the pool's `block_ids` (one each, in
        order). The blocks must stay allocated, and unread by any step, until
        `take_finished` reports the request."""
        self._loads.put((request_id, list(block_hashes), list(block_ids), time.monotonic()))

    def take_finished(self) -> dict[str, int]:
        """request_id -> how many leading blocks were loaded, for the loads that ended since
        the last call (fewer than asked: the next block was missing or bad). Copies the
        loaded blocks into the pool first (engine thread: 2 x num_layers index_copy_)."""
        if not self._finished:
            return {}
        with self._lock:
            done, self._finished = self._finished, {}
        kv_caches = self.kv_caches
        device = kv_caches[0][0].device
        counts = {}
        for request_id, (n, host, block_ids) in done.items():
            counts[request_id] = n
            if n:
                ids = torch.tensor(block_ids[:n], dtype=torch.long, device=device)
                src = host[:n].to(device)
                for layer, (k_cache, v_cache) in enumerate(kv_caches):
                    k_cache.index_copy_(0, ids, src[:, layer, 0])
                    v_cache.index_copy_(0, ids, src[:, layer, 1])
        return counts

    def take_load_seconds(self) -> list[float]:
        with self._lock:
            out, self.stats.load_seconds = self.stats.load_seconds, []
        return out

    def take_events(self) -> list[KVCacheEvent]:
        """The disk tier's changes since the last call as KV events (medium `MEDIUM_DISK`),
        in order: a run of blocks written is one BlockStored, a run dropped one
        BlockRemoved. Stored blocks carry no token ids (the pool's event had them)."""
        events: list[KVCacheEvent] = []
        for stored, run in itertools.groupby(self.store.take_changes(), key=lambda c: c[1]):
            hashes = [h for h, _ in run]
            events.append(BlockStored(hashes, block_size=self.block_shape[2],
                                      medium=MEDIUM_DISK) if stored
                          else BlockRemoved(hashes, medium=MEDIUM_DISK))
        return events

    def snapshot(self, pool_cached_blocks: int) -> TierSnapshot:
        """The tiers' gauges and counters now (engine thread); the load durations since the
        last snapshot are handed over once."""
        st, disk = self.stats, self.store.stats
        block_nbytes = self.store.block_nbytes
        return TierSnapshot(
            blocks={"memory": pool_cached_blocks, "disk": len(self.store)},
            bytes={"memory": pool_cached_blocks * block_nbytes, "disk": self.store.num_bytes},
            queries={"memory": st.memory_queries, "disk": st.disk_queries},
            hits={"memory": st.memory_hits, "disk": st.disk_hits},
            stores=disk.stores, loads=disk.loads, store_failures=disk.store_failures,
            load_failures=disk.load_failures, evictions=disk.evictions,
            writes_dropped=st.writes_dropped, load_seconds=tuple(self.take_load_seconds()))

    def check_invariants(self) -> None:
        """The disk tier's leak audit: no file on disk outside the index (a partial or
        orphaned write), at most the capacity indexed. O(files): tests and audits only.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        self.store.check_invariants()

    def shutdown(self) -> None:
        """Write the pool's cached blocks not yet on disk (so a restart finds every prefix
        this engine held), then stop both threads after the work queued (flushed). Call it
        once the engine thread has stopped stepping."""
        if self.block_pool is not None:
            self._write_pool(self.block_pool, deadline=time.monotonic() + SHUTDOWN_WRITE_S)
        for q in (self._writes, self._loads):
            q.put(None)
        for t in self._threads:
            t.join(timeout=3)

    def _write_pool(self, pool: BlockPool, deadline: float, batch: int = 64) -> None:
        """Queue the pool's cached blocks for the disk, `batch` at a time (bounded memory),
        until `deadline` (monotonic seconds): those left are logged, not written."""
        cached = list(pool.cached_block_hash_to_block.items())
        for start in range(0, len(cached), batch):
            while self._pending and time.monotonic() < deadline:
                time.sleep(0.005)
            if time.monotonic() >= deadline:
                logger.warning("disk tier: %d cached blocks not written at shutdown (took "
                               "over %.0f s)", len(cached) - start, SHUTDOWN_WRITE_S)
                return
            part = cached[start:start + batch]
            self.on_evict([b.block_id for _, b in part], [h for h, _ in part])

    # -- I/O threads ------------------------------------------------------------------------

    def _serve(self, q: queue.SimpleQueue, fn) -> None:
        while (item := q.get()) is not None:
            try:
                fn(*item)
            except Exception:  # never let one block take the tier down
                logger.exception("disk tier: %s failed", fn.__name__)
                if fn == self._load:  # the scheduler must hear of the load all the same
                    # NOTE: and its first block must go, or the request, back in the queue
                    # to recompute, would find it on disk and start the same load again.
                    if item[1]:
                        self.store.drop(item[1][0])
                    with self._lock:
                        self._finished[item[0]] = (0, None, [])

    def _write(self, hashes: list[BlockHash], buf: torch.Tensor) -> None:
        """Write each block of `buf` [num_layers, 2, len(hashes), ...] as the file payload
        [num_layers, 2, block_size, num_kv_heads, head_dim]: 2 x num_layers slices, no
        torch call (a CUDA pool's buffer is moved to the host once)."""
        host = (buf if buf.device.type == "cpu" else buf.cpu()).view(torch.uint8).numpy()
        num_layers = host.shape[0]
        try:
            for i, block_hash in enumerate(hashes):
                self.store.put(block_hash, [host[layer, kv, i].data
                                            for layer in range(num_layers) for kv in (0, 1)])
        finally:
            with self._lock:
                self._pending.difference_update(hashes)

    def _load(self, request_id: str, hashes: list[BlockHash], block_ids: list[int],
              started: float) -> None:
        """Read and verify the blocks into one host buffer [n, *block_shape], stopping at
        the first miss; the engine thread copies them into the pool (`take_finished`)."""
        host = torch.empty((len(hashes), *self.block_shape), dtype=self.dtype)
        raw = memoryview(host.view(torch.uint8).numpy()).cast("B")
        size = self.store.block_nbytes
        n = 0
        for block_hash in hashes:
            if not self.store.get_into(block_hash, raw[n * size:(n + 1) * size]):
                break
            n += 1
        with self._lock:
            self._finished[request_id] = (n, host, block_ids)
            self.stats.load_seconds.append(time.monotonic() - started)


def make_offloader(model_path: str, dtype: str, quantization: str, directory: str,
                   capacity_bytes: int, kv_caches: KVCaches,
                   kv_cache_manager) -> KVOffloader | None:
    """The engine's disk tier on `directory`, hooked to the pool's evictions; None when
    `directory` is empty, prefix caching is off, or every layer has a sliding window (its
    blocks leave the pool while the request runs: not offloaded, documented).

    Raises:
        ValueError / OSError: as DiskBlockStore (a size below one block, no directory).
    """
    if not directory or not kv_cache_manager.enable_caching:
        return None
    if kv_cache_manager.sliding_window is not None:
        logger.warning("disk tier: off, the model's layers all have a sliding window")
        return None
    k = kv_caches[0][0]
    block_nbytes = len(kv_caches) * 2 * k[0].numel() * k.element_size()
    identity = kv_identity(model=model_path, dtype=dtype, quantization=quantization,
                           num_layers=len(kv_caches), block_shape=tuple(k.shape[1:]))
    store = DiskBlockStore(directory, capacity_bytes, identity, block_nbytes)
    offloader = KVOffloader(store, kv_caches)
    offloader.block_pool = kv_cache_manager.block_pool
    kv_cache_manager.block_pool.on_evict = offloader.on_evict
    logger.info("disk tier: %s, %d blocks of %.2f MiB at most (%d on disk)", store.root,
                store.capacity_blocks, store.file_nbytes / 2**20, len(store))
    return offloader
