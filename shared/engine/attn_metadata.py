"""AttentionMetadata: the per-step tensors that tell attention where each token lives.

Worked example (block_size 4, two requests; request A decodes its 7th token, request B
runs a 3-token chunk of its prompt after 4 cached tokens):

    A: block_ids [5, 2]     positions [6]          slot 2*4+2 = 10
    B: block_ids [7, 3]     positions [4, 5, 6]    slots 12, 13, 14

    query_start_loc [0, 1, 4]   seq_lens [7, 7]   block_table [[5, 2], [7, 3]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64: block_id * block_size + offset where each new token's K/V goes."""
    block_table: torch.Tensor
    """[num_reqs, max_num_blocks_per_req] int32, padded with 0 (the null block)."""
    seq_lens: torch.Tensor
    """[num_reqs] int32: KV length of each request once this step's tokens are stored."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: offset of each request's first query token in the batch."""
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    """The first num_decodes requests have exactly one query token each."""
    verify_reqs: frozenset[int] = frozenset()
    """Requests scoring speculative drafts (last token + drafts): the CPU path runs their
    query tokens as decode rows (`kernels.torch_paged.prepare_torch_metadata`)."""
