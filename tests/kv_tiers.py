"""Test helpers of the disk tier (`--kv-offload-dir`): push every cached block of a pool
out to disk the way a full pool does, and wait for the writer."""

from __future__ import annotations

import time

from pdserve.shared.engine.engine_core import EngineCore


def evict_all(engine: EngineCore) -> None:
    """Evict every cached block of the pool as a full pool does (BlockPool.get_new_blocks
    hands them to the offloader's on_evict), then wait until the writer has put them on disk
    (or dropped them). Engine thread only: the offline LLM's caller, or `AsyncEngine.call`."""
    pool = engine.kv_cache_manager.block_pool
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
    assert pool.num_cached_blocks == 0
    wait_written(engine)


def wait_written(engine: EngineCore, timeout: float = 30.0) -> None:
    off = engine.kv_offloader
    assert off is not None, "the engine has no disk tier"
    deadline = time.monotonic() + timeout
    while off._pending:  # hashes queued for the writer, cleared once written or dropped
        assert time.monotonic() < deadline, "the disk tier's writer did not catch up"
        time.sleep(0.005)
