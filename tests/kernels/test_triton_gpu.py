"""The Triton kernels on a real CUDA device against the reference, per dtype (`gpu` marker)."""

import pytest
import torch

from pdserve.kernels import ops
from tests.kernels.batch_utils import make_paged_batch, random_mixed_lens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (32, 8, 128, 16), (8, 2, 96, 32)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_attention_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    seed: int,
) -> None:
    seq_lens, query_lens = random_mixed_lens(
        40, 6, max_seq_len=700, max_query_len=300, seed=seed)
    batch = make_paged_batch(
        seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, num_pad_tokens=3, dtype=dtype,
        device="cuda", seed=seed)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.attn_metadata, head_dim**-0.5)
    out = ops.paged_attention(*args, backend="triton")
    expected = ops.paged_attention(*args, backend="reference")
    assert not out.isnan().any()
    relative_error = float((out.float() - expected.float()).norm() / expected.float().norm())
    assert relative_error < TOLERANCES[dtype], relative_error


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_triton_store_matches_reference(dtype: torch.dtype) -> None:
    seq_lens, query_lens = random_mixed_lens(30, 4, max_seq_len=300, max_query_len=64, seed=4)
    batch = make_paged_batch(seq_lens, query_lens, num_kv_heads=4, head_dim=64,
                             num_pad_tokens=5, dtype=dtype, device="cuda")
    key = torch.randn(batch.slot_mapping.shape[0], 4, 64, device="cuda", dtype=dtype)
    value = torch.randn_like(key)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    ops.store_kv_cache(key, value, k_cache, v_cache, batch.slot_mapping, backend="triton")
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    ops.store_kv_cache(key, value, expected_k, expected_v, batch.slot_mapping,
                           backend="reference")
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)
