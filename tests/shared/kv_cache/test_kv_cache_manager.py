"""KVCacheManager golden tests: exact block ids, free-queue order, prefix hits, stats."""

from __future__ import annotations

import pytest

from pdserve.shared.kv_cache.block_pool import BlockStored
from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.kv_cache.prefix_hash import (
    BlockHasher,
    block_extra_keys,
    hash_request_tokens,
    request_block_hasher,
)
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.kv_cache.test_block_pool import Checked

BS = 16
HASHER = request_block_hasher(BS, "m")
"""The block hasher of `make_manager`'s managers (model "m")."""


def make_request(request_id: str, prompt_token_ids: list[int], cache_salt: str | None = None,
                 block_hasher: BlockHasher = HASHER) -> Request:
    return Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=100),
                   eos_token_id=None, cache_salt=cache_salt, block_hasher=block_hasher)


def make_manager(num_blocks: int, enable_caching: bool = True, model_name: str = "m"):
    manager = Checked(KVCacheManager(num_blocks, BS, enable_caching=enable_caching,
                                     model_name=model_name))
    manager.check_invariants()
    return manager


def free_ids(manager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def admit(manager, request: Request, num_new_tokens: int | None = None):
    """Prefix lookup + allocation + advance, as the scheduler does on admission."""
    hits, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    new = manager.allocate_slots(request, num_new_tokens, hits, num_hit)
    if new is not None:
        request.num_computed_tokens += num_hit + num_new_tokens
    return new, num_hit


def test_prefix_hit_golden_ids_and_free_order():
    manager = make_manager(11)
    common = list(range(3 * BS))
    a = make_request("a", common + [900 + i for i in range(7)])  # 55 tokens
    new, num_hit = admit(manager, a)
    assert num_hit == 0
    assert [b.block_id for b in new] == [1, 2, 3, 4]
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    assert manager.block_pool.num_cached_blocks == 3  # the partial 4th block is not
    assert manager.take_events() == [BlockStored(a.block_hashes, None, common, BS)]

    b = make_request("b", common + [700 + i for i in range(5)])  # 53 tokens
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2, 3] and num_hit == 48
    new, _ = admit(manager, b)
    assert [blk.block_id for blk in new] == [5]
    assert manager.get_block_ids("b") == [1, 2, 3, 5]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(1, 6)] == [2, 2, 2, 1, 1]

    manager.free(a)
    assert free_ids(manager) == [6, 7, 8, 9, 10, 4]
    manager.free(b)
    # Reverse order: b's tail block first, its prefix last (evicted last).
    assert free_ids(manager) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]
    assert manager.get_block_ids("b") == []

    # A third request hits the free cached prefix: it leaves the free queue.
    c = make_request("c", common + [1, 2])
    new, num_hit = admit(manager, c)
    assert num_hit == 48 and [blk.block_id for blk in new] == [6]
    assert manager.get_block_ids("c") == [1, 2, 3, 6]
    assert free_ids(manager) == [7, 8, 9, 10, 4, 5]

    # Eviction is LRU from the head: the cached prefix (held) survives.
    d = make_request("d", [5000 + i for i in range(6 * BS)])
    new, _ = admit(manager, d)
    assert [blk.block_id for blk in new] == [7, 8, 9, 10, 4, 5]
    manager.free(c)
    manager.free(d)
    assert manager.num_free_blocks == 10


def test_last_prompt_token_is_always_recomputed():
    manager = make_manager(10)
    prompt = list(range(2 * BS))
    warm = make_request("warm", prompt + [99])
    admit(manager, warm)
    manager.free(warm)
    # Exactly two full blocks cached, prompt of exactly 32 tokens: only 16 may hit.
    hits, num_hit = manager.get_computed_blocks(make_request("x", prompt))
    assert num_hit == BS and len(hits) == 1
    hits, num_hit = manager.get_computed_blocks(make_request("y", prompt + [7]))
    assert num_hit == 2 * BS and len(hits) == 2


def test_allocate_slots_returns_none_and_changes_nothing_when_full():
    manager = make_manager(5)  # 4 usable
    a = make_request("a", list(range(2 * BS)))
    admit(manager, a)
    manager.free(a)  # blocks 1, 2 free but cached
    stats_before = (manager.stats.requests, manager.stats.queries, manager.stats.hits)
    b = make_request("b", list(range(2 * BS)) + list(range(500, 500 + 3 * BS)))
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2]
    free_before = free_ids(manager)
    # Needs 2 hit blocks + 3 fresh = 5 > 4 usable, and the hits count against the free.
    assert manager.allocate_slots(b, 3 * BS, hits, num_hit) is None
    assert free_ids(manager) == free_before
    assert [blk.ref_cnt for blk in hits] == [0, 0]
    assert manager.get_block_ids("b") == []
    assert (manager.stats.requests, manager.stats.queries, manager.stats.hits) == stats_before
    # One fresh block fewer fits exactly.
    new = manager.allocate_slots(b, 2 * BS, hits, num_hit)
    assert [blk.block_id for blk in new] == [3, 4]
    assert manager.num_free_blocks == 0 and manager.usage == 1.0


def test_decode_growth_caches_output_blocks_incrementally():
    manager = make_manager(8)
    a = make_request("a", list(range(BS - 2)))
    admit(manager, a)
    assert manager.get_block_ids("a") == [1]
    assert manager.block_pool.num_cached_blocks == 0
    for step in range(BS + 3):
        a.append_output_token(1000 + step)
        new = manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        assert new is not None
        # A new block appears exactly when the token crosses a block boundary.
        assert len(new) == (1 if a.num_computed_tokens in (BS + 1, 2 * BS + 1) else 0)
    assert a.num_computed_tokens == 2 * BS + 1
    assert manager.get_block_ids("a") == [1, 2, 3]
    assert manager.block_pool.num_cached_blocks == 2
    expected = hash_request_tokens(a.all_token_ids, BS, block_extra_keys("m", None))
    assert a.block_hashes == expected
    # Another request whose prompt is a's prompt + output hits both blocks (output too).
    b = make_request("b", a.all_token_ids)
    assert manager.get_computed_blocks(b).num_computed_tokens == 2 * BS


def test_cache_salt_isolates_tenants():
    manager = make_manager(10)
    prompt = list(range(3 * BS))
    admit(manager, make_request("a", prompt, cache_salt="tenant-1"))
    assert manager.get_computed_blocks(make_request("b", prompt, "tenant-2")).blocks == []
    assert manager.get_computed_blocks(make_request("c", prompt)).blocks == []
    assert manager.get_computed_blocks(make_request("d", prompt, "tenant-1")) \
        .num_computed_tokens == 2 * BS


def test_model_name_enters_the_hash():
    prompt = list(range(2 * BS))
    m1 = KVCacheManager(4, BS, model_name="model-a")
    m2 = KVCacheManager(4, BS, model_name="model-b")
    a1 = make_request("a", prompt, block_hasher=m1.block_hasher)
    assert a1.block_hashes != make_request("a", prompt, block_hasher=m2.block_hasher).block_hashes
    assert a1.block_hashes == hash_request_tokens(prompt, BS, ("model-a",))


def test_delayed_caching():
    manager = make_manager(8)
    a = make_request("a", list(range(2 * BS + 1)))
    manager.allocate_slots(a, a.num_tokens, delay_cache_blocks=True)
    assert manager.take_events() == []
    assert manager.get_computed_blocks(make_request("b", a.prompt_token_ids)).blocks == []
    manager.cache_blocks(a, 2 * BS + 1)
    assert [len(e.block_hashes) for e in manager.take_events()] == [2]
    hits = manager.get_computed_blocks(make_request("b", a.prompt_token_ids)).blocks
    assert [blk.block_id for blk in hits] == [1, 2]


def test_duplicate_blocks_stay_uncached():
    """Two requests compute the same block concurrently: the first one to fill it wins."""
    manager = make_manager(10)
    prompt = list(range(2 * BS + 8))
    a = make_request("a", prompt)
    admit(manager, a, num_new_tokens=BS)  # first chunk only: block 1 cached
    b = make_request("b", prompt)
    _, num_hit = admit(manager, b)  # hits block 1, computes the rest itself
    assert num_hit == BS
    assert manager.get_block_ids("b") == [1, 2, 3]
    assert manager.block_pool.blocks[2].block_hash is not None
    # a's second chunk fills its block 4 with the hash block 2 already holds.
    manager.allocate_slots(a, a.num_tokens - a.num_computed_tokens)
    a.num_computed_tokens = a.num_tokens
    assert manager.get_block_ids("a") == [1, 4, 5]
    assert manager.block_pool.blocks[4].block_hash is None
    hits = manager.get_computed_blocks(make_request("c", prompt)).blocks
    assert [blk.block_id for blk in hits] == [1, 2]
    manager.free(a)
    assert free_ids(manager) == [6, 7, 8, 9, 5, 4]
    manager.free(b)
    assert free_ids(manager) == [6, 7, 8, 9, 5, 4, 3, 2, 1]


def test_prefix_cache_stats_count_once_per_admission():
    manager = make_manager(20)
    prompt = list(range(200))  # 12 full blocks + 8
    a = make_request("a", prompt)
    for _ in range(3):  # repeated lookups (a blocked request) are not counted
        manager.get_computed_blocks(a)
    admit(manager, a)
    assert (manager.stats.requests, manager.stats.queries, manager.stats.hits) == (1, 200, 0)
    b = make_request("b", prompt + [1, 2, 3])
    _, num_hit = admit(manager, b)
    assert num_hit == 192
    assert (manager.stats.requests, manager.stats.queries, manager.stats.hits) == (2, 403, 192)
    # Later chunks / decodes are not admissions.
    b.append_output_token(5)
    manager.allocate_slots(b, 1)
    assert manager.stats.requests == 2


def test_caching_disabled():
    manager = make_manager(10, enable_caching=False)
    prompt = list(range(3 * BS))
    a = make_request("a", prompt)
    admit(manager, a)
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    manager.free(a)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert manager.stats.requests == 0
    assert manager.take_events() == []


def test_reset_prefix_cache_through_manager():
    manager = make_manager(6)
    a = make_request("a", list(range(2 * BS + 1)))
    admit(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", a.prompt_token_ids)).blocks == []


def test_free_unknown_request_is_a_noop():
    manager = make_manager(4)
    manager.free(make_request("ghost", [1, 2, 3]))
    assert manager.num_free_blocks == 3


def test_manager_check_catches_ref_count_drift():
    manager = KVCacheManager(6, BS)
    a = make_request("a", list(range(BS + 1)))
    admit(manager, a)
    manager.check_invariants()
    manager.block_pool.blocks[1].ref_cnt += 1  # a reference nobody holds
    with pytest.raises(AssertionError, match="ref_cnt"):
        manager.check_invariants()


def test_known_block_hashes_are_extended_not_recomputed(monkeypatch):
    """A request created with hashes known already is hashed only past them, and gets the
    hashes a fresh hashing gives."""
    import pdserve.shared.kv_cache.prefix_hash as module

    prompt = list(range(1, 3 * BS + 5))
    fresh = make_request("fresh", prompt).block_hashes
    known = hash_request_tokens(prompt[:2 * BS], BS, block_extra_keys("m", None))
    calls = []
    real = module.hash_block_tokens
    monkeypatch.setattr(module, "hash_block_tokens",
                        lambda *args: calls.append(1) or real(*args))
    req = Request("known", prompt, SamplingParams(max_tokens=100), block_hasher=HASHER,
                  block_hashes=known)
    assert req.block_hashes == fresh and len(calls) == 1


def test_hashes_follow_the_tokens():
    """A request hashes each block once, when it fills up (prompt at creation, output as
    tokens append); a manager never hashes."""
    a = make_request("a", list(range(BS + 3)))
    assert len(a.block_hashes) == 1
    for _ in range(BS - 4):
        a.append_output_token(7)
    assert len(a.block_hashes) == 1
    a.append_output_token(7)
    assert a.block_hashes == hash_request_tokens(a.all_token_ids, BS, block_extra_keys("m", None))
    assert make_request("b", [1, 2], block_hasher=None).block_hashes == []
