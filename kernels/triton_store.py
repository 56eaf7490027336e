"""Triton kernel: write this step's K/V into the paged cache by slot (vLLM's reshape_and_cache).

One program per token copies the token's [num_kv_heads * head_dim] key and value rows into
cache slot slot_mapping[token] = block_id * block_size + offset; slot -1 (padding) returns
early, as nano-vllm's `store_kvcache_kernel` does.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride,
    value_stride,
    cache_block_stride,
    cache_offset_stride,
    block_size,
    ROW_SIZE: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    token_idx = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token_idx)
    if slot < 0:
        return
    block_id = slot // block_size
    offset = slot % block_size
    cols = tl.arange(0, BLOCK_ROW)
    mask = cols < ROW_SIZE
    key = tl.load(key_ptr + token_idx * key_stride + cols, mask=mask)
    value = tl.load(value_ptr + token_idx * value_stride + cols, mask=mask)
    dst = block_id * cache_block_stride + offset * cache_offset_stride + cols
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value into the caches at slot_mapping, in place (slot -1 skipped).

    Args:
        key: [num_tokens, num_kv_heads, head_dim], each token's heads contiguous.
        value: [num_tokens, num_kv_heads, head_dim], each token's heads contiguous.
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim], each slot contiguous.
        v_cache: same shape and strides as k_cache.
        slot_mapping: [num_tokens] int64, contiguous.
    """
    check_store_kv_cache_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    row_size = num_kv_heads * head_dim
    if num_tokens == 0:
        return
    _store_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), value.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.shape[1],
        ROW_SIZE=row_size, BLOCK_ROW=triton.next_power_of_2(row_size),
    )


def check_store_kv_cache_inputs(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Asserts the shapes, strides and devices `store_kv_cache` indexes with (its Args);
    token rows may be views with any token stride (k and v split from a fused qkv)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == head_dim, "cache slots not contiguous"
    for rows in (key, value):
        assert rows.stride(2) == 1 and rows.stride(1) == head_dim, "token rows not contiguous"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert slot_mapping.is_contiguous()
    assert key.device == value.device == k_cache.device == v_cache.device == slot_mapping.device
