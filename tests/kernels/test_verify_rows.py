"""Speculative verification rows (a last token + drafts) run as decode rows on the CPU
path (`AttentionMetadata.verify_reqs`) and match the reference, mixed with
decodes and chunked prefills."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kernels import ops, reference, torch_paged
from tests.kernels.batch_utils import make_paged_batch


@pytest.mark.parametrize("use_native", [True, False])
def test_verify_rows_match_reference(use_native: bool) -> None:
    # decode, verify (1 + 3 drafts), chunked prefill, verify (1 + 1), decode
    seq_lens, query_lens = [40, 57, 90, 17, 200], [1, 4, 30, 2, 1]
    batch = make_paged_batch(seq_lens, query_lens, num_heads=9, num_kv_heads=3, head_dim=64,
                             num_pad_tokens=2, seed=3)
    attn_metadata = dataclasses.replace(batch.attn_metadata, verify_reqs=frozenset({1, 3}))
    args = (batch.query, batch.k_cache, batch.v_cache, attn_metadata, 0.125)
    metadata = ops.prepare_torch_metadata(attn_metadata, block_size=16, num_kv_heads=3)
    assert len(metadata.prefills) == 1 and metadata.decode_rows.query_rows.numel() == 2 + 4 + 2
    out = torch_paged.paged_attention(*args, torch_metadata=metadata, use_native=use_native)
    expected = reference.paged_attention(*args)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
