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

from pdserve.kernels import reference  # noqa: E402
from pdserve.kernels.triton_decode import paged_decode  # noqa: E402
from pdserve.kernels.triton_prefill import paged_prefill  # noqa: E402
from pdserve.kernels.triton_store import store_kv_cache  # noqa: E402
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
    from pdserve.kernels import ops

    seq_lens, query_lens = random_mixed_lens(3, 2, max_seq_len=45, max_query_len=12, seed=seed)
    batch = make_paged_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=16,
                             num_pad_tokens=1, seed=seed)
    out = ops.paged_attention(batch.query, batch.k_cache, batch.v_cache,
                                  batch.attn_metadata, 0.2, backend="triton")
    return relative_error(out, reference_attention(batch, 0.2))


def check_window_soft_cap(seed: int) -> float:
    """Sliding window and soft cap through the triton backend (decodes, fresh and chunked
    prefills), the blocks before each window pointed at the NaN null block."""
    from pdserve.kernels import ops
    from tests.kernels.test_sliding_window import free_out_of_window_blocks

    seq_lens, query_lens = [70, 37, 60, 33, 9], [1, 37, 21, 1, 1]
    batch = make_paged_batch(seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_dim=16,
                             num_pad_tokens=1, seed=seed)
    assert free_out_of_window_blocks(batch, 19, 16) > 0
    args = (batch.query, batch.k_cache, batch.v_cache, batch.attn_metadata, 0.3)
    out = ops.paged_attention(*args, backend="triton", sliding_window=19, logits_soft_cap=2.0)
    expected = reference.paged_attention(*args, 19, 2.0)
    if out.isnan().any():
        return float("nan")
    return relative_error(out, expected)


class _EagerGraph:
    """Stand-in for a CUDA graph (none on CPU): each replay re-runs the captured forward
    over the runner's persistent buffers into the one static output."""

    def __init__(self, forward, pool) -> None:
        self.forward = forward
        self.output = forward().clone()

    def replay(self) -> None:
        self.output.copy_(self.forward())


def check_graph_padded_decode(seed: int) -> float:
    """The CUDA-graph runner's padded decode batch (3 requests in bucket 4: a padded request
    with q_len 0 and slot -1) through a 2-layer model on the Triton kernels, against the
    model on the reference backend: the outputs and every KV cache after the step."""
    import numpy as np

    from pdserve.kernels.attn_metadata import build_attn_metadata
    from pdserve.shared.engine.attention import PagedAttention
    from pdserve.shared.engine.cuda_graph import CUDAGraphRunner
    from pdserve.shared.models.llama import LlamaArgs, LlamaForCausalLM

    torch.manual_seed(seed)
    args = LlamaArgs(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                     rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                     tie_word_embeddings=True, attention_bias=False)
    model = LlamaForCausalLM(args).eval()
    # The embeddings are built empty (the loader fills them): uninitialized memory may
    # hold NaNs.
    torch.nn.init.normal_(model.embed_tokens.weight)
    caches = [(torch.randn(8, 16, 2, 16), torch.randn(8, 16, 2, 16)) for _ in range(2)]
    expected_caches = [(k.clone(), v.clone()) for k, v in caches]
    graphs = CUDAGraphRunner(model, caches, 16, 2, 128, (4,), torch.device("cpu"), "triton",
                             graph_factory=_EagerGraph)
    graphs.capture()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(caches, expected_caches))
    meta, positions, _ = build_attn_metadata(
        np.array([20, 5, 40]), np.ones(3, np.int64), [[1, 2], [3], [4, 5, 6]], 16,
        torch.device("cpu"))
    input_ids = torch.tensor([3, 9, 27])
    assert graphs.bucket(meta, 3) == 4
    out = graphs.run(input_ids, positions, meta, 4)
    with torch.inference_mode():
        expected = model(input_ids, positions, expected_caches,
                         PagedAttention(meta, "reference", 16, 2))
    cache_error = max(relative_error(a, b) for pair, ref in zip(caches, expected_caches)
                      for a, b in zip(pair, ref))
    return max(relative_error(out, expected), cache_error)


def main() -> None:
    results = {
        "store_kv_cache": max(check_store(seed) for seed in (0, 1)),
        "decode": check_decode(4, 2, 16, seed=0),
        "decode_gqa3_head_dim24": check_decode(6, 2, 24, seed=1),
        "prefill": check_prefill(seed=2),
        "mixed": check_mixed(seed=3),
        "graph_padded_decode": check_graph_padded_decode(seed=4),
        "window_soft_cap": check_window_soft_cap(seed=5),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
