"""Random paged-attention batches for the kernel tests: ragged, mixed, shuffled block tables."""

from typing import NamedTuple

import torch

from pdserve.kernels.attn_metadata import AttentionMetadata


class PagedBatch(NamedTuple):
    """One step's attention inputs, plus the dense K/V each request's cache holds."""

    query: torch.Tensor
    """[num_tokens, num_heads, head_dim] (num_tokens may exceed query_start_loc[-1])."""
    k_cache: torch.Tensor
    """[num_blocks, block_size, num_kv_heads, head_dim]; unused slots hold NaN."""
    v_cache: torch.Tensor
    block_table: torch.Tensor
    """[num_reqs, max_num_blocks_per_req] int32, a shuffled (non-identity) block assignment."""
    seq_lens: torch.Tensor
    """[num_reqs] int32."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32."""
    max_query_len: int
    max_seq_len: int
    dense_keys: list[torch.Tensor]
    """Per request [seq_len, num_kv_heads, head_dim], what the cache holds, built first."""
    dense_values: list[torch.Tensor]
    slot_mapping: torch.Tensor
    """[num_tokens] int64, slots of this step's query tokens (-1 for padding rows)."""

    @property
    def attn_metadata(self) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping, self.block_table, self.seq_lens,
                                 self.query_start_loc, self.max_query_len, self.max_seq_len)


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    num_pad_tokens: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    data_seed: int | None = None,
) -> PagedBatch:
    """Request i has seq_lens[i] keys, its last query_lens[i] positions are this step's queries.

    Blocks come from a random permutation of 1..num_blocks-1 (block 0 is the null block), the
    table is padded with 0, and every cache slot no request owns is NaN, so a kernel that reads
    past seq_len or through the padding poisons its output. `seed` draws the block
    assignment, `data_seed` (default: `seed`) the keys, values and queries, so batches that
    differ only in data_seed share one block table (as the layers of one step do).
    """
    assert len(seq_lens) == len(query_lens)
    assert all(1 <= q <= s for q, s in zip(query_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed if data_seed is None else data_seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 1 + 3  # null block plus a few never handed out
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_req)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    dense_keys, dense_values, slots = [], [], []  # slots: of this step's query tokens
    for req_idx, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        block_ids = [perm.pop() for _ in range(blocks_per_req[req_idx])]
        block_table[req_idx, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=data_gen).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=data_gen).to(dtype)
        positions = torch.arange(seq_len)
        block_of_pos = torch.tensor(block_ids)[positions // block_size]
        k_cache[block_of_pos, positions % block_size] = keys
        v_cache[block_of_pos, positions % block_size] = values
        slots += (block_of_pos * block_size + positions % block_size)[seq_len - q_len :].tolist()
        dense_keys.append(keys)
        dense_values.append(values)
    num_tokens = sum(query_lens) + num_pad_tokens
    query = torch.randn(num_tokens, num_heads, head_dim, generator=data_gen).to(dtype)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    slot_mapping = torch.tensor(slots + [-1] * num_pad_tokens, dtype=torch.int64)
    return PagedBatch(
        query.to(device), k_cache.to(device), v_cache.to(device), block_table.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc.to(device),
        max(query_lens), max(seq_lens), dense_keys, dense_values, slot_mapping.to(device))


def random_mixed_lens(
    num_decodes: int, num_prefills: int, *, max_seq_len: int, max_query_len: int, seed: int
) -> tuple[list[int], list[int]]:
    """Ragged (seq_lens, query_lens): decodes, fresh prefills and chunked prefills over a
    cached prefix, shuffled together."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    pairs = [(randint(1, max_seq_len), 1) for _ in range(num_decodes)]
    for i in range(num_prefills):
        q_len = randint(2, max_query_len)
        prefix = 0 if i % 3 == 0 else randint(1, max(1, max_seq_len - q_len))
        pairs.append((prefix + q_len, q_len))
    order = torch.randperm(len(pairs), generator=gen).tolist()
    return [pairs[i][0] for i in order], [pairs[i][1] for i in order]
