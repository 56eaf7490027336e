"""Prepacked oneDNN linear (kernels/cpu_linear.py) against F.linear."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_gemv, cpu_linear
from pdserve.shared.models.layers import PanelEmbedding

pytestmark = pytest.mark.skipif(not cpu_linear.is_available(),
                                reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("m", [1, 3, 64, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(m, with_bias):
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(96, 40, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(m, 40, generator=g)
    out = cpu_linear.linear(x, cpu_linear.pack_weight(weight), bias)
    assert out.shape == (m, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_rest_of_a_decode_batch():
    g = torch.Generator().manual_seed(0)
    packed = cpu_linear.pack_weight(torch.randn(3072, 576, generator=g))
    x = torch.randn(64, 576, generator=g)
    batched = cpu_linear.linear(x, packed)
    for row in (0, 17, 63):
        alone = cpu_linear.linear(x[row:row + 1].clone(), packed)
        assert torch.equal(alone[0], batched[row])


def test_pack_weight_rejects_what_it_cannot_pack():
    with pytest.raises(ValueError, match="float32"):
        cpu_linear.pack_weight(torch.randn(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        cpu_linear.pack_weight(torch.randn(4))


def test_model_switch_packs_every_linear_and_the_lm_head():
    from pdserve.shared.models.llama import Linear, LlamaArgs, LlamaForCausalLM

    args = LlamaArgs(vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_hidden_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                     max_position_embeddings=64, tie_word_embeddings=True,
                     attention_bias=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 8
    hidden = torch.randn(5, 32)
    model.set_packed_linear(False)
    assert all(m.packed is None for m in linears) and model.lm_head_packed is None
    plain = model.compute_logits(hidden)
    plain_embed = model.embed_tokens.weight.detach().clone()
    model.set_packed_linear(True)
    if cpu_gemv.load_kernel() is not None:  # the panels alone: one copy of each weight
        assert all(m.gemv is not None and m.packed is None and m.weight is None
                   for m in linears)
        assert model.lm_head_gemv is not None and model.lm_head_packed is None
        assert isinstance(model.embed_tokens, PanelEmbedding)  # tied: reads the head's panels
        assert not any(p.dim() == 2 for p in model.parameters())
    else:
        assert all(m.packed is not None for m in linears) and model.lm_head_packed is not None
    torch.testing.assert_close(model.compute_logits(hidden), plain, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, 63, 5, 64 - 1, 17])
    assert torch.equal(model.embed_tokens(ids), plain_embed[ids])
    x = torch.randn(5, 32)
    torch.testing.assert_close(linears[0](x), F.linear(x, linears[0].full_weight()),
                               rtol=1e-5, atol=1e-5)
    model.set_packed_linear(False)  # back: the plain weights are there again
    assert all(m.weight is not None and m.gemv is None for m in linears)
    torch.testing.assert_close(model.compute_logits(hidden), plain, rtol=0, atol=0)
    assert torch.equal(model.embed_tokens.weight, plain_embed)


def test_fewer_rows_than_min_rows_give_the_rows_of_a_min_rows_batch():
    """1-3 rows run padded to MIN_ROWS: each row equals, bit for bit, the same row computed
    in a batch of MIN_ROWS rows (so a single stream's logits do not depend on whether it
    decodes alone or beside 1-3 others)."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(960, 576, generator=g)
    packed = cpu_linear.pack_weight(weight)
    x = torch.randn(cpu_linear.MIN_ROWS, 576, generator=g)
    full = cpu_linear.linear(x, packed)
    for m in range(1, cpu_linear.MIN_ROWS):
        out = cpu_linear.linear(x[:m], packed)
        assert out.shape == (m, 960)
        assert torch.equal(out, full[:m])
    # The padding buffer is reused: rows left by an earlier, larger call (here inf and NaN)
    # must not reach a later, smaller call's rows.
    poison = torch.tensor([float("inf"), float("nan"), -1e30]).repeat_interleave(192)
    cpu_linear.linear(torch.stack([poison] * (cpu_linear.MIN_ROWS - 1)), packed)
    for m in (1, 2):
        assert torch.equal(cpu_linear.linear(x[:m], packed), full[:m])
    # A buffer first made under inference_mode (as an engine step makes it) is not the one
    # written outside it (an inference tensor cannot be updated in place there). A new
    # thread starts with no buffers.
    outs: list = []

    def inference_first() -> None:
        with torch.inference_mode():
            outs.append(cpu_linear.linear(x[:1], packed))
        outs.append(cpu_linear.linear(x[:1], packed))

    thread = threading.Thread(target=inference_first)
    thread.start()
    thread.join()
    assert len(outs) == 2 and all(torch.equal(o, full[:1]) for o in outs)
