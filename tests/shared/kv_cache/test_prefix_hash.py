"""Prefix hashes: pinned golden values, the canonical encoding, chaining, cross-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from pdserve.shared.kv_cache.prefix_hash import (
    NONE_HASH,
    block_extra_keys,
    hash_block_tokens,
    hash_request_tokens,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


# -- golden values: changing the algorithm must be a deliberate edit of these --------------

def test_none_hash_golden():
    assert NONE_HASH.hex() == "026726ec6e120dec4f0a30ecdf1b680a"


def test_block_hash_golden():
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 4]).hex() == \
        "456defd0e14f345ea8503ddd2022b122"
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 4],
                             ("SmolLM2-135M-Instruct", "tenant-a")).hex() == \
        "534e1ce91718996f20883560fd36b356"


def test_request_hash_chain_golden():
    hashes = hash_request_tokens(list(range(10)), 4, block_extra_keys("m", None))
    assert [h.hex() for h in hashes] == ["7998309a419a4d6991c448a62cf9a7d7",
                                         "16c512cfbf2443fcc33d54f9590c2bd1"]


def test_canonical_encoding_spelled_out():
    # parent | count u32 | tokens u32 LE | b"s" len u32 utf8 | b"b" len u32 raw | b"i" i64
    data = (NONE_HASH + (2).to_bytes(4, "little") + (7).to_bytes(4, "little")
            + (70000).to_bytes(4, "little")
            + b"s" + (2).to_bytes(4, "little") + "é".encode()
            + b"b" + (1).to_bytes(4, "little") + b"\x00"
            + b"i" + (-5).to_bytes(8, "little", signed=True))
    expected = xxhash.xxh3_128_digest(data, seed=0)
    assert hash_block_tokens(NONE_HASH, [7, 70000], ("é", b"\x00", -5)) == expected
    assert len(expected) == 16


# -- chaining and keys ----------------------------------------------------------------------

def test_chain_links_parent_and_extra_keys_enter_first_block_only():
    tokens = list(range(100, 112))
    keys = ("model", "salt")
    h0 = hash_block_tokens(NONE_HASH, tokens[0:4], keys)
    h1 = hash_block_tokens(h0, tokens[4:8])
    h2 = hash_block_tokens(h1, tokens[8:12])
    assert hash_request_tokens(tokens, 4, keys) == [h0, h1, h2]
    # The partial tail block is not hashed.
    assert hash_request_tokens(tokens + [1, 2, 3], 4, keys) == [h0, h1, h2]
    assert hash_request_tokens(tokens[:3], 4, keys) == []


def test_a_different_prefix_changes_every_later_hash():
    a = hash_request_tokens([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_request_tokens([1, 2, 3, 9, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]
    # Same last block, different parent: different hash.
    assert hash_block_tokens(a[0], [5, 6, 7, 8]) != hash_block_tokens(b[0], [5, 6, 7, 8])


def test_extra_keys_separate_models_and_salts():
    tokens = [5] * 8
    base = hash_request_tokens(tokens, 4, block_extra_keys("m", None))
    assert hash_request_tokens(tokens, 4, block_extra_keys("m2", None))[1] != base[1]
    assert hash_request_tokens(tokens, 4, block_extra_keys("m", "s"))[1] != base[1]
    # A missing salt and an empty salt are different tenants.
    assert hash_request_tokens(tokens, 4, block_extra_keys("m", ""))[0] != base[0]
    assert block_extra_keys("m", None) == ("m",)
    assert block_extra_keys("m", "s") == ("m", "s")


def test_extra_key_encoding_is_unambiguous():
    def h(keys):
        return hash_block_tokens(NONE_HASH, [1], keys)

    assert len({h(("ab",)), h(("a", "b")), h((b"ab",)), h(("1",)), h((1,)), h(())}) == 6


def test_bad_inputs_raise():
    with pytest.raises(TypeError):
        hash_block_tokens(NONE_HASH, [1], (True,))
    with pytest.raises(TypeError):
        hash_block_tokens(NONE_HASH, [1], (1.5,))
    with pytest.raises(ValueError, match="16 bytes"):
        hash_block_tokens(b"short", [1])
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(NONE_HASH, [-1])
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(NONE_HASH, [2**32])


# -- determinism across processes ---------------------------------------------------------

_SCRIPT = """
import json
from pdserve.shared.kv_cache.prefix_hash import NONE_HASH, hash_request_tokens, block_extra_keys
tokens = list(range(1000, 1070))
print(json.dumps([NONE_HASH.hex()] + [h.hex() for h in hash_request_tokens(
    tokens, 16, block_extra_keys("SmolLM2", "salt-\\u00e9"))]))
"""


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_hashes_equal_in_a_subprocess_with_another_hash_seed(hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, check=True, timeout=60)
    theirs = json.loads(out.stdout)
    ours = [NONE_HASH.hex()] + [h.hex() for h in hash_request_tokens(
        list(range(1000, 1070)), 16, block_extra_keys("SmolLM2", "salt-\u00e9"))]
    assert len(ours) == 1 + 70 // 16
    assert theirs == ours
