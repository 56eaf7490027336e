"""The pool's KV cache events carry vLLM's fields: chained hashes, token ids, LoRA, medium."""

from __future__ import annotations

from pdserve.shared.kv_cache.block_pool import (
    MEDIUM_MEMORY,
    BlockPool,
    BlockRemoved,
    BlockStored,
)
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.kv_cache.test_block_pool import HASHES, Checked
from tests.shared.kv_cache.test_kv_cache_manager import BS, admit, make_manager, make_request


def test_prefill_then_decode_events_chain_and_carry_tokens():
    manager = make_manager(10)
    prompt = list(range(100, 100 + 2 * BS + 3))  # 2 full blocks + 3
    a = make_request("a", prompt)
    admit(manager, a)
    h = a.block_hashes
    assert manager.take_events() == [
        BlockStored([h[0], h[1]], None, prompt[:2 * BS], BS, None, MEDIUM_MEMORY, None)]
    # Decoding fills the third block with 3 prompt tokens and 13 output tokens.
    out = list(range(900, 900 + BS - 3))
    for token in out:
        a.append_output_token(token)
        manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert a.num_computed_tokens == 3 * BS
    manager.cache_blocks(a, a.num_computed_tokens)
    assert manager.take_events() == [
        BlockStored([a.block_hashes[2]], h[1], prompt[2 * BS:] + out, BS, None,
                    MEDIUM_MEMORY, None)]


def test_a_hit_between_new_blocks_splits_the_event():
    """Each event's tokens are exactly its blocks' tokens: a block already cached in the
    middle ends one run and the next block starts another, chained to the hit."""
    pool = Checked(BlockPool(8, True))
    tokens = list(range(64))  # HASHES: these tokens in blocks of 4
    request = Request("r", tokens, SamplingParams(max_tokens=1))
    blocks = pool.get_new_blocks(4)
    blocks[1].block_hash = HASHES[1]  # as a prefix hit would have left it
    pool.cached_block_hash_to_block[HASHES[1]] = blocks[1]
    pool.cache_full_blocks(blocks, HASHES, 0, 4, request, 4)
    assert pool.take_events() == [
        BlockStored([HASHES[0]], None, tokens[0:4], 4, None, MEDIUM_MEMORY, None),
        BlockStored([HASHES[2], HASHES[3]], HASHES[1], tokens[8:16], 4, None, MEDIUM_MEMORY,
                    None)]


def test_lora_request_is_named_in_the_event():
    manager = make_manager(10)
    lora = LoRARequest("sql-adapter", 7, "/adapters/sql")
    a = Request("a", list(range(BS + 1)), SamplingParams(max_tokens=4), lora_request=lora)
    a.set_block_hasher(manager.block_hasher)
    admit(manager, a)
    (event,) = manager.take_events()
    assert (event.lora_id, event.lora_name, event.token_ids) == (7, "sql-adapter",
                                                                 list(range(BS)))


def test_eviction_event_names_the_medium():
    manager = make_manager(4)  # 3 usable blocks
    a = make_request("a", list(range(2 * BS + 1)))
    admit(manager, a)
    manager.free(a)
    manager.take_events()
    b = make_request("b", list(range(500, 500 + 3 * BS)))
    admit(manager, b)
    # a's blocks were freed tail first, so its second block is evicted first.
    assert manager.take_events()[0] == BlockRemoved([a.block_hashes[1], a.block_hashes[0]],
                                                    MEDIUM_MEMORY)


def test_events_off_slices_no_tokens():
    """With events off the pool never reads the request (the hot path stays as cheap)."""

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"read {name} with events off")

    pool = BlockPool(8, True, enable_kv_cache_events=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HASHES, 0, 2, Untouchable(), 4)  # type: ignore[arg-type]
    assert pool.num_cached_blocks == 2 and pool.take_events() == []
