"""Sliding-window attention and logit soft-capping on the paged cache (issue 34): the
reference against dense attention built independently, and the fast CPU path (native kernel
and torch-ops fallback) against the reference, with the blocks wholly before each request's
window replaced by the null block (NaN), as the KV cache manager frees them."""

import pytest
import torch

from pdserve.kernels import reference, torch_paged
from tests.kernels.batch_utils import PagedBatch, make_paged_batch, random_mixed_lens


def free_out_of_window_blocks(batch: PagedBatch, window: int, block_size: int) -> int:
    """Point every block wholly before a request's first query's window at the null block
    (block 0, NaN in these caches), in place; returns how many were replaced."""
    starts = batch.query_start_loc.tolist()
    freed = 0
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        key_lo = max(0, seq_len - q_len - window + 1)
        for b in range(key_lo // block_size):
            batch.block_table[i, b] = 0
            freed += 1
    return freed


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    window: int | None, cap: float | None) -> torch.Tensor:
    """A request's last q_len queries over its dense keys, in float64 with an explicit mask:
    query at position p sees keys p - window < k <= p; scores capped as c * tanh(s / c)."""
    q_len, seq_len = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    if cap:
        scores = cap * torch.tanh(scores / cap)
    pos_q = torch.arange(seq_len - q_len, seq_len)[:, None]
    pos_k = torch.arange(seq_len)[None, :]
    visible = pos_k <= pos_q
    if window:
        visible &= pos_k > pos_q - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)


@pytest.mark.parametrize(("window", "cap"), [(5, None), (16, None), (23, 50.0), (None, 3.0),
                                             (1, None)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_reference_matches_dense_attention(window, cap, block_size) -> None:
    seq_lens, query_lens = random_mixed_lens(6, 4, max_seq_len=90, max_query_len=30, seed=3)
    batch = make_paged_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=16,
                             block_size=block_size, num_pad_tokens=2, seed=3)
    if window:
        assert free_out_of_window_blocks(batch, window, block_size) > 0
    out = reference.paged_attention(batch.query, batch.k_cache, batch.v_cache,
                                    batch.attn_metadata, 0.25, window, cap)
    starts = batch.query_start_loc.tolist()
    for i in range(len(seq_lens)):
        expected = dense_attention(batch.query[starts[i]:starts[i + 1]], batch.dense_keys[i],
                                   batch.dense_values[i], 0.25, window, cap)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], expected, rtol=1e-5,
                                   atol=1e-5)
    assert torch.all(out[starts[-1]:] == 0)


@pytest.mark.parametrize(("window", "cap"), [(7, None), (40, None), (33, 20.0), (None, 2.0)])
@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(4, 2, 16, 8), (8, 4, 32, 16)])
def test_torch_path_matches_reference(window, cap, use_native, num_heads, num_kv_heads,
                                      head_dim, block_size) -> None:
    """Decodes, fresh prefills and chunked prefills over a cached prefix, in one batch; the
    freed blocks hold NaN, so reading one poisons the output."""
    seq_lens, query_lens = random_mixed_lens(12, 4, max_seq_len=150, max_query_len=40, seed=1)
    batch = make_paged_batch(seq_lens, query_lens, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim,
                             block_size=block_size, num_pad_tokens=2, seed=1)
    if window:
        assert free_out_of_window_blocks(batch, window, block_size) > 0
    args = (batch.query, batch.k_cache, batch.v_cache, batch.attn_metadata, head_dim ** -0.5)
    expected = reference.paged_attention(*args, window, cap)
    metadata = torch_paged.prepare_torch_metadata(batch.attn_metadata, block_size,
                                                  num_kv_heads, sliding_window=window)
    out = torch_paged.paged_attention(*args, torch_metadata=metadata, use_native=use_native,
                                      sliding_window=window, logits_soft_cap=cap)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


def test_window_and_cap_change_the_result() -> None:
    """The options are not ignored: each gives another answer than plain attention."""
    batch = make_paged_batch([60, 45], [1, 12], num_heads=4, num_kv_heads=2, head_dim=16,
                             seed=2)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.attn_metadata, 0.5)
    plain = torch_paged.paged_attention(*args)
    windowed = torch_paged.paged_attention(*args, sliding_window=8)
    capped = torch_paged.paged_attention(*args, logits_soft_cap=1.0)
    assert (windowed - plain).abs().max() > 1e-2
    assert (capped - plain).abs().max() > 1e-2


def test_metadata_of_another_window_is_refused() -> None:
    batch = make_paged_batch([30], [1], seed=0)
    metadata = torch_paged.prepare_torch_metadata(batch.attn_metadata, 16, 2)
    with pytest.raises(AssertionError, match="another window"):
        torch_paged.paged_attention(batch.query, batch.k_cache, batch.v_cache,
                                    batch.attn_metadata, 0.3, torch_metadata=metadata,
                                    sliding_window=8)
