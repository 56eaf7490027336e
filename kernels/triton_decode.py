"""Triton kernel: paged decode attention, one query token per request over its block table.

PagedAttention (Kwon et al. 2023) with FlashAttention's online softmax (Dao et al. 2022): one
program per (request, kv head) walks the request's blocks one cache block at a time, keeping
a running max, running sum and output accumulator, so no score vector is ever materialized.
The kv head's query heads (its GQA group) are packed as the rows of one tile, so each K/V
block is loaded once per group; the group is padded to 16 rows for tl.dot.

Requests whose q_len is not 1 return at once: `kernels/triton_prefill.py` handles them. So
both kernels launch over the whole batch and the host needs no per-request lengths.
"""

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import check_paged_attention_inputs, soft_cap_tanh

if TYPE_CHECKING:
    from pdserve.kernels.attn_metadata import AttentionMetadata


@triton.jit
def _paged_decode_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale,
    soft_cap,
    query_token_stride,
    query_head_stride,
    out_token_stride,
    out_head_stride,
    cache_block_stride,
    cache_offset_stride,
    cache_head_stride,
    block_table_stride,
    GROUP_SIZE: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
):
    req_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req_idx)
    q_end = tl.load(query_start_loc_ptr + req_idx + 1)
    if q_end - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + req_idx)

    groups = tl.arange(0, BLOCK_GROUP)
    dims = tl.arange(0, BLOCK_DIM)
    offsets = tl.arange(0, BLOCK_SIZE)
    dim_mask = dims < HEAD_DIM
    q_mask = (groups < GROUP_SIZE)[:, None] & dim_mask[None, :]
    heads = kv_head * GROUP_SIZE + groups
    q_ptrs = (query_ptr + q_start.to(tl.int64) * query_token_stride
              + heads[:, None] * query_head_stride + dims[None, :])
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # [BLOCK_GROUP, BLOCK_DIM]

    m_i = tl.full([BLOCK_GROUP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_GROUP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], dtype=tl.float32)
    block_table_row = block_table_ptr + req_idx.to(tl.int64) * block_table_stride
    # With a window only keys seq_len - W .. seq_len - 1 are read: the blocks before the one
    # holding the window's first key may be freed (the null block).
    key_lo = 0
    if SLIDING_WINDOW > 0:
        key_lo = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    for block_idx in range(key_lo // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block_id = tl.load(block_table_row + block_idx).to(tl.int64)
        positions = block_idx * BLOCK_SIZE + offsets
        is_key = (positions < seq_len) & (positions >= key_lo)
        kv_ptrs = (block_id * cache_block_stride + offsets[:, None] * cache_offset_stride
                   + kv_head * cache_head_stride + dims[None, :])
        kv_mask = is_key[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_SIZE, BLOCK_DIM]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if USE_SOFT_CAP:
            scores = soft_cap * soft_cap_tanh(scores / soft_cap)
        scores = tl.where(is_key[None, :], scores, float("-inf"))  # [BLOCK_GROUP, BLOCK_SIZE]
        # NOTE: the first block always holds key key_lo, so m_new is finite from the start.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        probs = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    out_ptrs = (out_ptr + q_start.to(tl.int64) * out_token_stride
                + heads[:, None] * out_head_stride + dims[None, :])
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_metadata: "AttentionMetadata",
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Writes out[query_start_loc[i]] for every request i with q_len 1; other rows untouched.
    `sliding_window`, `logits_soft_cap`: as `kernels.ops.paged_attention`.

    query, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim] (`kernels.paged_attention` has the contract).
    """
    dims = check_paged_attention_inputs(query, k_cache, v_cache, attn_metadata, out)
    block_table = attn_metadata.block_table
    num_reqs = block_table.shape[0]
    if num_reqs == 0:
        return
    _paged_decode_kernel[(num_reqs, dims.num_kv_heads)](
        query, k_cache, v_cache, block_table, attn_metadata.seq_lens,
        attn_metadata.query_start_loc, out, scale, float(logits_soft_cap or 0.0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        GROUP_SIZE=dims.group_size,
        BLOCK_GROUP=max(16, triton.next_power_of_2(dims.group_size)),
        HEAD_DIM=dims.head_dim,
        BLOCK_DIM=dims.block_dim,
        BLOCK_SIZE=dims.block_size,
        DOT_PRECISION=dims.dot_precision,
        SLIDING_WINDOW=int(sliding_window or 0),
        USE_SOFT_CAP=bool(logits_soft_cap),
    )
