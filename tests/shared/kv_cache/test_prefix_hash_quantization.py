"""The weights' quantization is a prefix-hash extra key: int8 and fp32 blocks never share a
hash, fp32 hashes are unchanged, and a pool never hands one mode's blocks to the other."""

from __future__ import annotations

import xxhash

from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.kv_cache.prefix_hash import (
    NONE_HASH,
    block_extra_keys,
    hash_block_tokens,
    hash_request_tokens,
)
from tests.shared.kv_cache.test_kv_cache_manager import BS, admit, make_request

PROMPT = list(range(3 * BS))


def test_extra_keys_carry_the_mode_unless_none():
    assert block_extra_keys("m", None) == ("m",)
    assert block_extra_keys("m", None, "none") == ("m",)
    assert block_extra_keys("m", None, "") == ("m",)  # a peer that predates the field
    assert block_extra_keys("m", None, "int8") == ("m", b"quantization=int8")
    assert block_extra_keys("m", "salt", "int8") == ("m", "salt", b"quantization=int8")


def test_block_hashes_of_the_two_modes_differ_and_fp32_is_unchanged():
    fp32 = hash_request_tokens(PROMPT, BS, block_extra_keys("SmolLM2-135M-Instruct", None))
    int8 = hash_request_tokens(PROMPT, BS,
                               block_extra_keys("SmolLM2-135M-Instruct", None, "int8"))
    assert len(fp32) == len(int8) == 3
    assert all(a != b for a, b in zip(fp32, int8))  # the chain carries the first block's key
    assert fp32 == hash_request_tokens(PROMPT, BS, ("SmolLM2-135M-Instruct",))


def test_int8_block_hash_golden():
    got = hash_block_tokens(NONE_HASH, [1, 2, 3, 4], block_extra_keys("m", None, "int8"))
    # parent | count | tokens | b"s" len "m" | b"b" len b"quantization=int8"
    key = b"quantization=int8"
    data = (NONE_HASH + (4).to_bytes(4, "little")
            + b"".join(t.to_bytes(4, "little") for t in (1, 2, 3, 4))
            + b"s" + (1).to_bytes(4, "little") + b"m"
            + b"b" + len(key).to_bytes(4, "little") + key)
    assert got == xxhash.xxh3_128_digest(data, seed=0)


def test_no_str_salt_collides_with_the_mode():
    salted = hash_request_tokens(PROMPT, BS, block_extra_keys("m", "quantization=int8"))
    int8 = hash_request_tokens(PROMPT, BS, block_extra_keys("m", None, "int8"))
    assert salted != int8


def test_a_pool_never_serves_one_modes_blocks_to_the_other():
    int8 = KVCacheManager(10, BS, model_name="m", quantization="int8")
    fp32 = KVCacheManager(10, BS, model_name="m")
    a = make_request("a", PROMPT, block_hasher=int8.block_hasher)
    b = make_request("b", PROMPT, block_hasher=fp32.block_hasher)
    assert a.block_hashes == hash_request_tokens(
        PROMPT, BS, block_extra_keys("m", None, "int8"))
    assert set(a.block_hashes).isdisjoint(b.block_hashes)
    admit(int8, a)
    # a hash computed by an fp32 engine finds nothing in the int8 pool
    assert all(int8.block_pool.get_cached_block(h) is None for h in b.block_hashes)
    assert int8.get_computed_blocks(make_request("c", PROMPT, block_hasher=int8.block_hasher)
                                    ).num_computed_tokens == 2 * BS
