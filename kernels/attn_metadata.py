"""AttentionMetadata: one step's paged-attention inputs, built once and read by every layer.

Shaped as vLLM v1's `CommonAttentionMetadata`; every backend in `kernels/` takes it whole.
Request i (its batch index, its row of block_table) owns query rows
query_start_loc[i] : query_start_loc[i + 1], its last q_len_i positions. A worked example,
every tensor written out: tests/shared/engine/test_prepare_inputs_golden.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64: block_id * block_size + offset where each token's K/V goes;
    -1 (padding) is not written."""
    block_table: torch.Tensor
    """[num_reqs, max_num_blocks_per_req] int32, padded with 0 (the null block)."""
    seq_lens: torch.Tensor
    """[num_reqs] int32: KV length of each request once this step's tokens are stored."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: batch row of each request's first query token; rows past
    query_start_loc[-1] are padding (attention writes zeros there)."""
    max_query_len: int
    """Host int, max q_len (sizes the Triton prefill grid)."""
    max_seq_len: int
    """Host int, max of seq_lens."""
    verify_reqs: frozenset[int] = frozenset()
    """Batch indices of requests scoring speculative drafts (last token + drafts): the CPU
    path runs their query rows as decode rows (`kernels.torch_paged`)."""


def build_attn_metadata(
    start_pos: np.ndarray,
    query_lens: np.ndarray,
    block_ids: Sequence[list[int]],
    block_size: int,
    device: torch.device,
    verify_reqs: frozenset[int] = frozenset(),
) -> tuple[AttentionMetadata, torch.Tensor, np.ndarray]:
    """The step's metadata, from each request's first new position (`start_pos`, its
    num_computed_tokens), token count (`query_lens`, >= 1) and blocks (covering
    start_pos + query_len tokens). [num_reqs] int64 arrays in, tensors on `device` out.

    Returns:
        (metadata, positions [num_tokens] int64 on `device`, query_start_loc as a host
        [num_reqs + 1] int64 array).
    """
    num_reqs = len(query_lens)
    query_start_loc = np.zeros(num_reqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = start_pos + query_lens
    block_table = np.zeros((num_reqs, max(len(ids) for ids in block_ids)), np.int32)
    for i, ids in enumerate(block_ids):
        block_table[i, :len(ids)] = ids
    req_indices = np.repeat(np.arange(num_reqs), query_lens)  # batch index of each token
    positions = (np.arange(int(query_start_loc[-1]), dtype=np.int64)
                 - query_start_loc[req_indices] + start_pos[req_indices])
    slot_mapping = (block_table[req_indices, positions // block_size].astype(np.int64)
                    * block_size + positions % block_size)
    metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        block_table=torch.from_numpy(block_table).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        verify_reqs=verify_reqs,
    )
    return metadata, torch.from_numpy(positions).to(device), query_start_loc
