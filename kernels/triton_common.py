"""Launch-time checks shared by the Triton paged-attention wrappers (decode and prefill)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from pdserve.kernels.attn_metadata import AttentionMetadata


class AttentionDims(NamedTuple):
    """Sizes the Triton attention kernels take as constexprs."""

    num_heads: int
    num_kv_heads: int
    group_size: int
    head_dim: int
    block_dim: int
    """head_dim rounded up to a power of two (at least 16, for tl.dot)."""
    block_size: int
    dot_precision: str
    """"ieee" for float32 inputs (tl.dot would use TF32 on the GPU otherwise), else "tf32"."""


def check_paged_attention_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    out: torch.Tensor,
) -> AttentionDims:
    """Asserts the shapes, dtypes and strides the kernels index with; returns the sizes.

    query/out: [num_tokens, num_heads, head_dim], last dim contiguous.
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous,
    same strides. The metadata's tensors on query's device, block_table's last dim and
    seq_lens, query_start_loc contiguous.
    """
    block_table, seq_lens = attn_metadata.block_table, attn_metadata.seq_lens
    query_start_loc = attn_metadata.query_start_loc
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_reqs = block_table.shape[0]
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k_cache.stride(3) == 1, "cache head_dim must be contiguous"
    assert query.stride(2) == 1 and out.stride(2) == 1, "query/out head_dim must be contiguous"
    assert out.shape == query.shape and out.dtype == query.dtype
    assert query.dtype == k_cache.dtype == v_cache.dtype
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of 2 >= 16"
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    assert seq_lens.shape == (num_reqs,) and seq_lens.dtype == torch.int32
    assert query_start_loc.shape == (num_reqs + 1,) and query_start_loc.dtype == torch.int32
    assert seq_lens.is_contiguous() and query_start_loc.is_contiguous()
    devices = {t.device for t in (query, k_cache, v_cache, block_table, seq_lens, out)}
    assert len(devices | {query_start_loc.device}) == 1, "all inputs on one device"
    return AttentionDims(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        group_size=num_heads // num_kv_heads,
        head_dim=head_dim,
        block_dim=max(16, triton.next_power_of_2(head_dim)),
        block_size=block_size,
        dot_precision="ieee" if query.dtype == torch.float32 else "tf32",
    )


@triton.jit
def soft_cap_tanh(x):
    """tanh(x) from exp (tl.math's tanh is missing in some Triton builds and in the
    interpreter): 1 - 2 / (exp(2x) + 1), exact at +-inf (+-1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
