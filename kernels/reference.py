"""Plain-torch reference for the paged KV cache: slow, per request, obviously right.

Every other backend (the fast CPU path in `kernels/torch_paged.py`, the Triton kernels) is
tested against these two functions. Nothing here is tuned; the code follows the definition
of paged attention (PagedAttention, Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention") one request at a time, in float32.

Cache layout, per layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    token at position p of request i lives in block block_table[i, p // block_size],
    row p % block_size; its slot is block_id * block_size + p % block_size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.kernels.attn_metadata import AttentionMetadata


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`kernels.store_kv_cache`, one token at a time: key/value [num_tokens, num_kv_heads,
    head_dim] into slot_mapping's slots, in place; slot -1 (padding) is not written."""
    block_size = k_cache.shape[1]
    for token_idx, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block_id, offset = divmod(slot, block_size)
        k_cache[block_id, offset] = key[token_idx]
        v_cache[block_id, offset] = value[token_idx]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """`kernels.paged_attention`, by its definition: request i owns query rows
    query_start_loc[i] : query_start_loc[i + 1], its LAST q_len_i positions; the query at
    position p attends to the request's keys 0 ... p (with `sliding_window` W: only keys
    p - W + 1 ... p, transformers' `kv_idx > q_idx - W`; keys before the first query's window
    are never read), query head h reading kv head h // (num_heads // num_kv_heads) (GQA).
    With `logits_soft_cap` c each scaled score s becomes c * tanh(s / c) (Gemma 2) before the
    mask. Computed in float32; rows past query_start_loc[-1] are zero.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    block_table = attn_metadata.block_table
    starts = attn_metadata.query_start_loc.tolist()
    for req_idx, seq_len in enumerate(attn_metadata.seq_lens.tolist()):
        start, end = starts[req_idx], starts[req_idx + 1]
        q_len = end - start
        if q_len == 0:
            continue
        key_lo = max(0, seq_len - q_len - sliding_window + 1) if sliding_window else 0
        key_pos = torch.arange(key_lo, seq_len, device=query.device)
        block_ids = block_table[req_idx].long()[key_pos // block_size]
        offsets = key_pos % block_size
        # [seq_len, num_heads, head_dim]: each kv head repeated for its query group
        k = k_cache[block_ids, offsets].float().repeat_interleave(group_size, dim=1)
        v = v_cache[block_ids, offsets].float().repeat_interleave(group_size, dim=1)
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, num_keys]
        if logits_soft_cap:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        is_visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, num_keys]
        if sliding_window:
            is_visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
        scores = scores.masked_fill(~is_visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
