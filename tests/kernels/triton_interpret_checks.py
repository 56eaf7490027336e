"""Runs every Triton kernel under TRITON_INTERPRET=1 against the reference; prints JSON.

Run by `test_triton_interpret.py` in a subprocess: the interpreter flag is read when triton
is imported, so it must be set before that import and must not leak into other test modules.
Prints {"check name": relative error (‖out - ref‖ / ‖ref‖), ...}; fp32 only (the interpreter's
bf16 tl.dot is wrong), tiny shapes (the interpreter is ~400x slower than torch).
"""

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.triton_decode import paged_decode  # noqa: E402
from kernels.triton_prefill import paged_prefill  # noqa: E402
from kernels.triton_store import store_kv_cache  # noqa: E402
from tests.kernels.batch_utils import (  # noqa: E402
    PagedBatch,
    make_paged_batch,
    random_mixed_lens,
)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out - expected).norm() / expected.norm())


def reference_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    return reference.paged_attention(batch.query, batch.k_cache, batch.v_cache,
                                     batch.attn_metadata, scale)


def check_store(seed: int) -> float:
    seq_lens, query_lens = random_mixed_lens(4, 2, max_seq_len=40, max_query_len=10, seed=seed)
    batch = make_paged_batch(seq_lens, query_lens, num_kv_heads=2, head_dim=16,
                             num_pad_tokens=2, seed=seed)
    key = torch.randn(batch.slot_mapping.shape[0], 2, 16)
    value = torch.randn_like(key)
    caches = [batch.k_cache.clone() for _ in range(2)] + [batch.v_cache.clone() for _ in range(2)]
    store_kv_cache(key, value, caches[0], caches[2], batch.slot_mapping)
    reference.store_kv_cache(key, value, caches[1], caches[3], batch.slot_mapping)
    # NaN marks slots nobody owns: both must leave them alone.
    written = torch.cat([c.nan_to_num(7.0).flatten() for c in (caches[0], caches[2])])
    expected = torch.cat([c.nan_to_num(7.0).flatten() for c in (caches[1], caches[3])])
    return relative_error(written, expected)


def check_decode(num_heads: int, num_kv_heads: int, head_dim: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 70, (5,), generator=gen).tolist()
    batch = make_paged_batch(seq_lens, [1] * 5, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, seed=seed)
    out = torch.zeros_like(batch.query)
    paged_decode(batch.query, batch.k_cache, batch.v_cache, batch.attn_metadata, 0.3, out)
    return relative_error(out, reference_attention(batch, 0.3))


def check_prefill(seed: int) -> float:
    # Fresh and chunked prefills (cached prefix); block_m=16 gives several tiles per request.
    seq_lens, query_lens = [37, 50, 20], [37, 21, 5]
    batch = make_paged_batch(seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_dim=16,
                             seed=seed)
    out = torch.zeros_like(batch.query)
    paged_prefill(batch.query, batch.k_cache, batch.v_cache, batch.attn_metadata, 0.25, out,
                  block_m=16)
    return relative_error(out, reference_attention(batch, 0.25))


def check_mixed(seed: int) -> float:
    """Decodes and prefills in one batch, through the package's triton backend."""
    import kernels

    seq_lens, query_lens = random_mixed_lens(3, 2, max_seq_len=45, max_query_len=12, seed=seed)
    batch = make_paged_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=16,
                             num_pad_tokens=1, seed=seed)
    out = kernels.paged_attention(batch.query, batch.k_cache, batch.v_cache,
                                  batch.attn_metadata, 0.2, backend="triton")
    return relative_error(out, reference_attention(batch, 0.2))


def main() -> None:
    results = {
        "store_kv_cache": max(check_store(seed) for seed in (0, 1)),
        "decode": check_decode(4, 2, 16, seed=0),
        "decode_gqa3_head_dim24": check_decode(6, 2, 24, seed=1),
        "prefill": check_prefill(seed=2),
        "mixed": check_mixed(seed=3),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
