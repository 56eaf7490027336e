"""BlockPool and FreeBlockQueue: golden block ids, free-queue order, events, invariants."""

from __future__ import annotations

import pytest

from pdserve.shared.kv_cache.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeBlockQueue,
    KVCacheBlock,
)
from pdserve.shared.kv_cache.prefix_hash import hash_request_tokens


class Checked:
    """Proxy that runs `check_invariants()` after every method call on the wrapped object."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        attr = getattr(self._obj, name)
        if not callable(attr) or name == "check_invariants":
            return attr

        def call(*args, **kwargs):
            result = attr(*args, **kwargs)
            self._obj.check_invariants()
            return result
        return call


def make_pool(num_blocks: int, enable_caching: bool = True) -> BlockPool:
    pool = Checked(BlockPool(num_blocks, enable_caching))
    pool.check_invariants()
    return pool


def free_ids(pool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


HASHES = hash_request_tokens(list(range(64)), 4)  # 16 distinct chained hashes


# -- FreeBlockQueue -------------------------------------------------------------------------

def test_free_queue_order_and_o1_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append_n([blocks[0]])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2, 0]
    assert q.num_free_blocks == 5
    with pytest.raises(ValueError):
        q.remove(KVCacheBlock(9))  # not linked
    for _ in range(5):
        q.popleft()
    assert q.num_free_blocks == 0 and q.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        q.popleft()


# -- allocation and free order --------------------------------------------------------------

def test_init_null_block_is_never_free():
    pool = make_pool(6)
    assert free_ids(pool) == [1, 2, 3, 4, 5]
    assert pool.get_num_free_blocks() == 5
    assert pool.get_usage() == 0.0
    assert pool.null_block.block_id == 0
    with pytest.raises(ValueError):
        BlockPool(1, True)


def test_get_new_blocks_pops_from_head_and_free_appends_to_tail():
    pool = make_pool(10)
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9]
    assert pool.get_usage() == pytest.approx(3 / 9)
    pool.free_blocks([a[2], a[0]])
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9, 3, 1]
    b = pool.get_new_blocks(7)
    assert ids(b) == [4, 5, 6, 7, 8, 9, 3]
    assert free_ids(pool) == [1]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [1]  # a failed request changes nothing
    pool.free_blocks([a[1]] + b)
    assert free_ids(pool) == [1, 2, 4, 5, 6, 7, 8, 9, 3]
    assert pool.get_num_free_blocks() == 9


def test_double_free_raises():
    pool = make_pool(4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([block])


# -- caching, hits, eviction ----------------------------------------------------------------

def test_cache_touch_and_evict_lru():
    pool = make_pool(6)
    blocks = pool.get_new_blocks(3)  # [1, 2, 3]
    pool.cache_full_blocks(blocks, HASHES, 0, 2)  # blocks 1, 2 full; 3 partial
    assert [b.block_hash for b in blocks] == [HASHES[0], HASHES[1], None]
    assert pool.num_cached_blocks == 2
    assert pool.take_events() == [BlockStored([HASHES[0], HASHES[1]])]
    assert pool.take_events() == []

    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 5, 3, 2, 1]
    # Still findable while free.
    assert pool.get_cached_block(HASHES[0]) is blocks[0]
    assert pool.get_cached_block(HASHES[5]) is None

    # A hit revives a free cached block: it leaves the queue.
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert free_ids(pool) == [4, 5, 3, 2]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2

    # Allocating 4 takes the head first; block 2 is evicted (hash dropped), 3 had none.
    new = pool.get_new_blocks(4)
    assert ids(new) == [4, 5, 3, 2]
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(HASHES[1]) is None
    assert pool.take_events() == [BlockRemoved([HASHES[1]], "GPU")]
    assert pool.num_cached_blocks == 1

    pool.free_blocks([blocks[0]])
    assert free_ids(pool) == []  # still held once
    pool.free_blocks([blocks[0]])
    assert free_ids(pool) == [1]
    assert pool.get_cached_block(HASHES[0]) is blocks[0]


def test_cache_full_blocks_is_incremental_and_skips_hashed_blocks():
    pool = make_pool(8)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, HASHES, 0, 1)
    pool.cache_full_blocks(blocks, HASHES, 1, 3)
    pool.cache_full_blocks(blocks, HASHES, 3, 3)  # nothing new
    # The second event chains to the first: its parent is the block before it.
    assert pool.take_events() == [BlockStored([HASHES[0]]),
                                  BlockStored([HASHES[1], HASHES[2]], HASHES[0])]
    # A second request holding the hit block 1 then two fresh blocks.
    pool.touch([blocks[0]])
    other = [blocks[0]] + pool.get_new_blocks(2)
    pool.cache_full_blocks(other, HASHES, 0, 2)
    # Block 1 already carries HASHES[0]; the fresh block 5 duplicates HASHES[1] (held by
    # block 2) and stays uncached: the map is one-to-one.
    assert ids(other) == [1, 5, 6]
    assert other[1].block_hash is None
    assert pool.get_cached_block(HASHES[1]) is blocks[1]
    assert pool.take_events() == []


def test_caching_disabled_never_hashes():
    pool = make_pool(5, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HASHES, 0, 2)
    assert [b.block_hash for b in blocks] == [None, None]
    assert pool.num_cached_blocks == 0
    assert pool.take_events() == []


def test_events_can_be_disabled():
    pool = Checked(BlockPool(5, True, enable_kv_cache_events=False))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HASHES, 0, 2)
    pool.free_blocks(blocks)
    pool.get_new_blocks(4)
    assert pool.num_cached_blocks == 0
    assert pool.take_events() == []


def test_reset_prefix_cache_only_when_idle():
    pool = make_pool(5)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HASHES, 0, 2)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert [b.block_hash for b in blocks] == [None, None]
    assert pool.take_events() == [AllBlocksCleared([HASHES[0], HASHES[1]], "GPU")]
    assert free_ids(pool) == [3, 4, 1, 2]


# -- the checker catches corruption ----------------------------------------------------------

@pytest.mark.parametrize("corrupt", [
    "negative_ref", "free_with_ref", "held_unlinked", "hash_not_in_map", "map_mismatch",
    "null_touched", "counter_off",
])
def test_check_invariants_catches_corruption(corrupt):
    pool = BlockPool(6, True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HASHES, 0, 1)
    pool.check_invariants()
    if corrupt == "negative_ref":
        blocks[1].ref_cnt = -1
    elif corrupt == "free_with_ref":
        pool.free_block_queue.get_all_free_blocks()[0].ref_cnt = 1
    elif corrupt == "held_unlinked":
        blocks[1].ref_cnt = 0  # ref 0 but not in the free queue
    elif corrupt == "hash_not_in_map":
        blocks[1].block_hash = HASHES[1]
    elif corrupt == "map_mismatch":
        pool.cached_block_hash_to_block[HASHES[0]] = blocks[1]
    elif corrupt == "null_touched":
        pool.null_block.ref_cnt = 1
    elif corrupt == "counter_off":
        pool.free_block_queue.num_free_blocks += 1
    with pytest.raises(AssertionError):
        pool.check_invariants()
