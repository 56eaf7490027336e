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

import torch


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key/value into its cache slot, in place.

    Args:
        key: [num_tokens, num_kv_heads, head_dim].
        value: [num_tokens, num_kv_heads, head_dim].
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place.
        v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place.
        slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset;
            -1 marks a padding token that is not written.
    """
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
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Causal attention of a mixed batch (decodes and chunked prefills) over the paged cache.

    Request i owns query rows query_start_loc[i] : query_start_loc[i + 1] (q_len_i of them).
    They are its LAST q_len_i positions, seq_lens[i] - q_len_i ... seq_lens[i] - 1, and the
    query at position p attends to the request's keys at positions 0 ... p. Query head h
    reads kv head h // (num_heads // num_kv_heads) (GQA).

    Args:
        query: [num_tokens, num_heads, head_dim].
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim]; this step's keys are
            already stored.
        v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        block_table: [num_reqs, max_num_blocks_per_req] int32, 0-padded.
        seq_lens: [num_reqs] int32, KV length of each request after this step.
        query_start_loc: [num_reqs + 1] int32, offsets of each request's query rows.
        scale: softmax scale, usually head_dim ** -0.5.
        max_query_len: unused here (kept for the common signature).
        max_seq_len: unused here (kept for the common signature).

    Returns:
        [num_tokens, num_heads, head_dim], query's dtype. Rows past
        query_start_loc[num_reqs] are zero.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for req_idx, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[req_idx], starts[req_idx + 1]
        q_len = end - start
        if q_len == 0:
            continue
        key_pos = torch.arange(seq_len, device=query.device)
        block_ids = block_table[req_idx].long()[key_pos // block_size]
        offsets = key_pos % block_size
        # [seq_len, num_heads, head_dim]: each kv head repeated for its query group
        k = k_cache[block_ids, offsets].float().repeat_interleave(group_size, dim=1)
        v = v_cache[block_ids, offsets].float().repeat_interleave(group_size, dim=1)
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        is_visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
        scores = scores.masked_fill(~is_visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
