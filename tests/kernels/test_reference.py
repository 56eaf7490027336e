"""The plain-torch reference against attention built independently from dense K/V."""

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import reference
from tests.kernels.batch_utils import make_paged_batch, random_mixed_lens


def dense_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of a request's last q_len queries, via full-sequence causal SDPA.

    query: [q_len, num_heads, head_dim]; keys/values: [seq_len, num_kv_heads, head_dim].
    The earlier positions get throwaway queries; causal masking makes them irrelevant.
    """
    q_len, seq_len = query.shape[0], keys.shape[0]
    full_query = torch.randn(seq_len, *query.shape[1:], dtype=query.dtype)
    full_query[seq_len - q_len :] = query
    group_size = query.shape[1] // keys.shape[1]
    out = F.scaled_dot_product_attention(
        full_query.transpose(0, 1).double(),
        keys.repeat_interleave(group_size, dim=1).transpose(0, 1).double(),
        values.repeat_interleave(group_size, dim=1).transpose(0, 1).double(),
        is_causal=True, scale=scale)
    return out.transpose(0, 1)[seq_len - q_len :].to(query.dtype)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 4, 16, 16), (6, 2, 32, 8), (9, 3, 64, 16)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_dense_sdpa(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int
) -> None:
    seq_lens, query_lens = random_mixed_lens(
        6, 4, max_seq_len=90, max_query_len=30, seed=seed)
    batch = make_paged_batch(
        seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, num_pad_tokens=3, seed=seed)
    scale = head_dim**-0.5
    out = reference.paged_attention(batch.query, batch.k_cache, batch.v_cache,
                                    batch.attn_metadata, scale)
    starts = batch.query_start_loc.tolist()
    for req_idx in range(len(seq_lens)):
        start, end = starts[req_idx], starts[req_idx + 1]
        expected = dense_causal_attention(
            batch.query[start:end], batch.dense_keys[req_idx], batch.dense_values[req_idx], scale)
        torch.testing.assert_close(out[start:end], expected, rtol=1e-5, atol=1e-5)
    assert torch.all(out[starts[-1] :] == 0), "padding rows must be zero"


def test_reference_store_writes_slots_and_skips_padding() -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 3
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.tensor([17, -1, 4, 9, -1], dtype=torch.int64)
    key = torch.randn(5, num_kv_heads, head_dim)
    value = torch.randn(5, num_kv_heads, head_dim)
    reference.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    for token_idx, (block_id, offset) in {0: (4, 1), 2: (1, 0), 3: (2, 1)}.items():
        assert torch.equal(k_cache[block_id, offset], key[token_idx])
        assert torch.equal(v_cache[block_id, offset], value[token_idx])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 3, "only three slots written"
