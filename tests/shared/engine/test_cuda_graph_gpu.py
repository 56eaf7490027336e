"""Real CUDA graphs of the decode step (`gpu` marker): a small random Llama on the GPU,
replayed per bucket against its eager forward. Needs no checkpoint, so it runs in
scripts/gpu_check.sh's first stage, before the model arrives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels.attn_metadata import build_attn_metadata
from pdserve.shared.engine.attention import PagedAttention
from pdserve.shared.engine.cuda_graph import CUDAGraphRunner
from pdserve.shared.models.llama import LlamaArgs, LlamaForCausalLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK_SIZE = 16
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def tiny_model(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=512, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
                     rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                     max_position_embeddings=512, tie_word_embeddings=True,
                     attention_bias=False)
    model = LlamaForCausalLM(args)
    # The embeddings are built empty (the loader fills them): uninitialized memory may
    # hold NaNs.
    torch.nn.init.normal_(model.embed_tokens.weight)
    model = model.to(device="cuda", dtype=dtype).eval()
    model.rotary.to("cuda", dtype)
    return model


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_graph_replays_equal_the_eager_forward(dtype: torch.dtype) -> None:
    model = tiny_model(dtype)
    num_blocks = 72
    shape = (num_blocks, BLOCK_SIZE, 2, 32)
    caches = [(torch.randn(shape, device="cuda", dtype=dtype),
               torch.randn(shape, device="cuda", dtype=dtype)) for _ in range(4)]
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    graphs = CUDAGraphRunner(model, caches, BLOCK_SIZE, 2, 512, (1, 2, 4, 8),
                             torch.device("cuda"))
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    for (k, v), (k0, v0) in zip(caches, eager_caches):  # capture wrote no KV
        assert torch.equal(k, k0) and torch.equal(v, v0)
    gen = np.random.default_rng(0)
    # 8 then 7 (the padded row's buffers still hold the 8th request's slot), 3, 1, 4.
    for step, n in enumerate((8, 7, 3, 1, 4)):
        starts = gen.integers(0, 100, n)
        blocks = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(n)]
        meta, positions, _ = build_attn_metadata(starts, np.ones(n, np.int64), blocks,
                                                 BLOCK_SIZE, torch.device("cuda"))
        input_ids = torch.from_numpy(gen.integers(0, 512, n)).cuda()
        batch = graphs.bucket(meta, n)
        assert batch == next(s for s in (1, 2, 4, 8) if s >= n)
        before = [(k.clone(), v.clone()) for k, v in caches]
        out = graphs.run(input_ids, positions, meta, batch).clone()
        with torch.inference_mode():
            expected = model(input_ids, positions, eager_caches,
                             PagedAttention(meta, "triton", BLOCK_SIZE, 2))
        assert not out.isnan().any()
        assert relative_error(out, expected) < TOLERANCES[dtype], (step, n)
        written = set(meta.slot_mapping.tolist())
        for (k0, v0), (k1, v1), (ek, ev) in zip(before, caches, eager_caches):
            changed = ((k0 != k1) | (v0 != v1)).flatten(2).any(2).flatten()
            assert set(changed.nonzero().flatten().tolist()) == written, (step, n)
            assert relative_error(k1, ek) < TOLERANCES[dtype]
            assert relative_error(v1, ev) < TOLERANCES[dtype]
    assert graphs.num_replays == 5


def test_replay_runs_no_python(monkeypatch) -> None:
    """A replay is the captured kernels alone: with the model's Python forward made to raise
    after the capture, the replay still answers, and answers for the new inputs."""
    model = tiny_model(torch.float32)
    shape = (16, BLOCK_SIZE, 2, 32)
    caches = [(torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda"))
              for _ in range(4)]
    graphs = CUDAGraphRunner(model, caches, BLOCK_SIZE, 2, 512, (2,), torch.device("cuda"))
    graphs.capture()

    def forbidden(*args, **kwargs):
        raise AssertionError("the replay ran the Python forward")

    outputs = []
    with monkeypatch.context() as m:
        m.setattr(LlamaForCausalLM, "forward", forbidden)
        for token in (7, 8):
            meta, positions, _ = build_attn_metadata(np.array([5]), np.ones(1, np.int64),
                                                     [[1]], BLOCK_SIZE, torch.device("cuda"))
            input_ids = torch.tensor([token], device="cuda")
            outputs.append(graphs.run(input_ids, positions, meta, 2).clone())
    assert outputs[0].shape == (1, 256)
    assert not torch.equal(outputs[0], outputs[1])
