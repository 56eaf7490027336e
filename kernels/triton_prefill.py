"""Triton kernel: chunked-prefill attention over a paged prefix.

A request with q_len > 1 holds seq_len keys: a cached prefix of context_len = seq_len - q_len
keys followed by the chunk's own q_len. Its query at chunk row r sits at position
context_len + r and attends to keys 0 .. context_len + r (bottom-right causal). One program
per (request, tile of BLOCK_M query rows, query head) streams the request's K/V one cache
block at a time through the block table (PagedAttention, Kwon et al. 2023) with
FlashAttention's online softmax (Dao et al. 2022), and stops at the tile's last visible key.

Requests with q_len <= 1 return at once (`kernels/triton_decode.py` handles decodes), as do
tiles past a request's q_len, so the grid is sized from max_query_len alone.
"""

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import check_paged_attention_inputs, soft_cap_tanh

if TYPE_CHECKING:
    from pdserve.kernels.attn_metadata import AttentionMetadata

DEFAULT_BLOCK_M = 64


@triton.jit
def _paged_prefill_kernel(
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
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
):
    req_idx = tl.program_id(0)
    tile_idx = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP_SIZE
    q_start = tl.load(query_start_loc_ptr + req_idx)
    q_len = tl.load(query_start_loc_ptr + req_idx + 1) - q_start
    if q_len <= 1:
        return
    if tile_idx * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req_idx)
    context_len = seq_len - q_len

    rows = tile_idx * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_DIM)
    offsets = tl.arange(0, BLOCK_SIZE)
    dim_mask = dims < HEAD_DIM
    row_mask = (rows < q_len)[:, None] & dim_mask[None, :]
    query_pos = context_len + rows  # [BLOCK_M]
    tokens = (q_start + rows).to(tl.int64)
    q_ptrs = (query_ptr + tokens[:, None] * query_token_stride + head * query_head_stride
              + dims[None, :])
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)  # [BLOCK_M, BLOCK_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DIM], dtype=tl.float32)
    block_table_row = block_table_ptr + req_idx.to(tl.int64) * block_table_stride
    # Keys past the tile's last query position are invisible to every row of the tile.
    kv_end = tl.minimum(seq_len, context_len + (tile_idx + 1) * BLOCK_M)
    # With a window the tile's first row sees keys from its position - W + 1 on: blocks
    # wholly before that are not read (they may be freed: the null block).
    key_lo = 0
    if SLIDING_WINDOW > 0:
        key_lo = tl.maximum(context_len + tile_idx * BLOCK_M - SLIDING_WINDOW + 1, 0)
    for block_idx in range(key_lo // BLOCK_SIZE, tl.cdiv(kv_end, BLOCK_SIZE)):
        block_id = tl.load(block_table_row + block_idx).to(tl.int64)
        positions = block_idx * BLOCK_SIZE + offsets
        is_key = positions < seq_len
        kv_ptrs = (block_id * cache_block_stride + offsets[:, None] * cache_offset_stride
                   + kv_head * cache_head_stride + dims[None, :])
        kv_mask = is_key[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_SIZE, BLOCK_DIM]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if USE_SOFT_CAP:
            scores = soft_cap * soft_cap_tanh(scores / soft_cap)
        is_visible = (positions[None, :] <= query_pos[:, None]) & is_key[None, :]
        if SLIDING_WINDOW > 0:
            is_visible &= positions[None, :] > query_pos[:, None] - SLIDING_WINDOW
        scores = tl.where(is_visible, scores, float("-inf"))  # [BLOCK_M, BLOCK_SIZE]
        # NOTE: without a window key 0 is visible to every row, so m_new is finite after the
        # first block; with one a row may see nothing in a block yet (m_new -inf): exp is
        # then taken against 0 so that no -inf - -inf NaN appears.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_ref)
        probs = tl.exp(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + tokens[:, None] * out_token_stride + head * out_head_stride + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_metadata: "AttentionMetadata",
    scale: float,
    out: torch.Tensor,
    block_m: int = DEFAULT_BLOCK_M,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Writes the query rows of every request with q_len > 1; other rows untouched.

    query, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim], the chunk's own keys already stored
    (`kernels.paged_attention` has the contract). `attn_metadata.max_query_len` sizes the
    grid; `block_m`: query rows per program, a power of two >= 16. `sliding_window`,
    `logits_soft_cap`: as `kernels.ops.paged_attention`.
    """
    dims = check_paged_attention_inputs(query, k_cache, v_cache, attn_metadata, out)
    assert block_m >= 16 and block_m & (block_m - 1) == 0
    block_table, max_query_len = attn_metadata.block_table, attn_metadata.max_query_len
    num_reqs = block_table.shape[0]
    if num_reqs == 0 or max_query_len <= 1:
        return
    grid = (num_reqs, triton.cdiv(max_query_len, block_m), dims.num_heads)
    _paged_prefill_kernel[grid](
        query, k_cache, v_cache, block_table, attn_metadata.seq_lens,
        attn_metadata.query_start_loc, out, scale, float(logits_soft_cap or 0.0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        GROUP_SIZE=dims.group_size,
        HEAD_DIM=dims.head_dim,
        BLOCK_DIM=dims.block_dim,
        BLOCK_M=block_m,
        BLOCK_SIZE=dims.block_size,
        DOT_PRECISION=dims.dot_precision,
        SLIDING_WINDOW=int(sliding_window or 0),
        USE_SOFT_CAP=bool(logits_soft_cap),
    )
