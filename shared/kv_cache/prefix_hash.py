"""Chained block hashes for automatic prefix caching, stable across processes and machines.

A block's hash names its whole prefix: it covers the parent block's hash, the block's own
token ids and (first block only) the extra keys, so two blocks with equal hashes hold equal
KV. Gateway, prefill and decode instances must agree on these values, hence a fixed-seed
xxh3-128 over a canonical byte encoding and never Python's `hash()` (salted per process).

    hash(block i) = xxh3_128(canonical(parent = hash(block i-1) or NONE_HASH,
                                       tokens of block i,
                                       extra_keys if i == 0 else ()), seed=0)

Canonical encoding (all little-endian):

    parent (16 B) | count (u32) | token_0 (u32) ... token_{count-1} (u32) | extra key ...
    extra key:  b"s" | len (u32) | UTF-8 bytes      (str)
                b"b" | len (u32) | raw bytes        (bytes)
                b"i" | value (i64)                  (int, not bool)

The extra keys of a first block are the served model name, the cache salt (when given),
for a quantized model `b"quantization=<mode>"` (a bytes key, so no str salt can collide
with it): KV computed by int8 weights is never served to an fp32 engine or back, and fp32
hashes are those of before quantization existed; and, for a sequence a longrope model
rotates with its long factors (`Request.rope_long`), `b"rope=long"`: long and short KV of
one prefix differ, and are never served for each other; and, for a request under a LoRA
adapter, `b"lora=<adapter name>"` (vLLM keys LoRA blocks by the adapter's name too): KV of one
adapter is never served to another or to the base model, whose hashes are unchanged.

NOTE: changing any of this changes every hash; the golden values pinned in
tests/shared/kv_cache/test_prefix_hash.py make that a deliberate, visible edit.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from pdserve.shared.request import Request

BlockHash = bytes
"""16 bytes: the xxh3-128 digest (seed 0) of a block's canonical encoding."""

ExtraKey = str | bytes | int

BlockHasher = Callable[["Request"], list[BlockHash]]
"""request -> the hashes of its full blocks past `request.block_hashes` (vLLM's
`get_request_block_hasher`; `Request.update_block_hashes` calls it)."""

HASH_SEED = 0
BLOCK_HASH_NUM_BYTES = 16

NONE_HASH: BlockHash = xxhash.xxh3_128_digest(b"pdserve.prefix_hash.NONE_HASH", seed=HASH_SEED)
"""The parent of the first block of every sequence (a fixed constant)."""

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


def _encode_extra_key(key: ExtraKey) -> bytes:
    if isinstance(key, str):
        raw = key.encode("utf-8")
        return b"s" + _U32.pack(len(raw)) + raw
    if isinstance(key, bytes):
        return b"b" + _U32.pack(len(key)) + key
    if isinstance(key, int) and not isinstance(key, bool):
        return b"i" + _I64.pack(key)
    raise TypeError(f"extra key must be str, bytes or int, got {type(key).__name__}")


def hash_block_tokens(
    parent_block_hash: BlockHash,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
) -> BlockHash:
    """Hash one block given its parent's hash.

    Args:
        parent_block_hash: the previous block's hash, or `NONE_HASH` for the first block.
        token_ids: this block's token ids, each in [0, 2**32).
        extra_keys: keys that separate otherwise equal prefixes (model, cache salt).

    Returns:
        The 16-byte digest.

    Raises:
        ValueError: a parent that is not 16 bytes, or a token id outside [0, 2**32).
        TypeError: an extra key that is not str, bytes or int.
    """
    if len(parent_block_hash) != BLOCK_HASH_NUM_BYTES:
        raise ValueError(f"parent_block_hash must be {BLOCK_HASH_NUM_BYTES} bytes, "
                         f"got {len(parent_block_hash)}")
    n = len(token_ids)
    try:
        data = parent_block_hash + struct.pack(f"<I{n}I", n, *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be ints in [0, 2**32): {e}") from None
    if extra_keys:
        data += b"".join(_encode_extra_key(k) for k in extra_keys)
    return xxhash.xxh3_128_digest(data, seed=HASH_SEED)


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[ExtraKey] = (),
    parent_block_hash: BlockHash = NONE_HASH,
) -> list[BlockHash]:
    """The chained hashes of every *full* block of `token_ids` (a partial tail is skipped),
    the first chained on `parent_block_hash` (a sequence's first block: `NONE_HASH`).

    `extra_keys` enter the first block only; the chain carries them to later blocks.
    """
    hashes: list[BlockHash] = []
    parent = parent_block_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size],
                                   extra_keys if start == 0 else ())
        hashes.append(parent)
    return hashes


def block_extra_keys(model_name: str, cache_salt: str | None,
                     quantization: str = "none", rope_long: bool = False,
                     lora_name: str | None = None) -> tuple[ExtraKey, ...]:
    """The extra keys of a request's first block: the served model name, then the salt, then
    the weights' quantization unless "none" (or "", a peer that predates the field), then
    `b"rope=long"` for KV rotated with longrope's long factors, then `b"lora=<name>"` for a
    request under the LoRA adapter `lora_name` (None: the base model).

    A missing salt is left out rather than encoded as "", so `None` and `""` stay distinct.
    """
    keys: tuple[ExtraKey, ...] = (model_name,) if cache_salt is None else (model_name, cache_salt)
    if quantization not in ("", "none"):
        keys += (b"quantization=" + quantization.encode("utf-8"),)
    if rope_long:
        keys += (b"rope=long",)
    if lora_name is not None:
        keys += (b"lora=" + lora_name.encode("utf-8"),)
    return keys


def request_block_hasher(block_size: int, model_name: str, quantization: str = "none"
                         ) -> BlockHasher:
    """The hasher an engine hands its requests: it hashes a request's full blocks that
    `request.block_hashes` lacks, chained on its last hash, the first block with
    `block_extra_keys` (the model, the request's salt, this quantization, its `rope_long` and
    its LoRA adapter). O(new full blocks) per call: nothing once every block is hashed."""

    def hash_new_full_blocks(request: Request) -> list[BlockHash]:
        hashes = request.block_hashes
        start, end = len(hashes) * block_size, request.num_tokens // block_size * block_size
        if end <= start:
            return []
        if hashes:
            return hash_request_tokens(request.token_slice(start, end), block_size,
                                       parent_block_hash=hashes[-1])
        lora = request.lora_request
        return hash_request_tokens(request.token_slice(0, end), block_size, block_extra_keys(
            model_name, request.cache_salt, quantization, request.rope_long,
            lora and lora.lora_name))

    return hash_new_full_blocks
