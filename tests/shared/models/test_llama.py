"""The paged Llama model's math against transformers on the same weights, independent of
the paged kernels (a dense causal attention stands in for one sequence)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.shared.models.llama import LlamaArgs, LlamaForCausalLM
from pdserve.shared.models.loader import load_model, read_hf_config
from pdserve.shared.models.rotary import RotaryEmbedding, rope_parameters


class DenseCausalAttention:
    """One sequence, no cache: causal SDPA over the step's own K/V (GQA expanded); full
    attention only (SmolLM2)."""

    def forward(self, q, k, v, k_cache, v_cache, scale, sliding_window=None,
                logits_soft_cap=None):
        assert sliding_window is None and logits_soft_cap is None
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=True, scale=scale)
        return out.transpose(0, 1)


@pytest.fixture(scope="module")
def model(model_path):
    return load_model(model_path)


def test_args_from_smollm2_config(model_path):
    args = LlamaArgs.from_hf_config(read_hf_config(model_path))
    assert (args.num_hidden_layers, args.hidden_size, args.num_heads, args.num_kv_heads,
            args.head_dim, args.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert args.rope_theta == 100000.0
    assert args.tie_word_embeddings and not args.attention_bias


def test_unsupported_architecture_is_a_value_error():
    with pytest.raises(ValueError, match="architecture"):
        LlamaArgs.from_hf_config({"architectures": ["GPT2LMHeadModel"]})


def test_logits_match_transformers(model, model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    x = torch.tensor(ids)
    with torch.inference_mode():
        ref = hf(x[None]).logits[0]
        hidden = model(x, torch.arange(len(ids)), [(None, None)] * 30, DenseCausalAttention())
        ours = model.compute_logits(hidden)
    assert ours.shape == ref.shape == (len(ids), 49152)
    # NOTE: atol 5e-4 on logits of magnitude ~10-20: fp32 rounding of another GEMM
    # (oneDNN's prepacked kernels, kernels/cpu_linear.py) over 30 layers; the greedy parity
    # suite checks the tokens themselves.
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=5e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_rope_parameters_merge_old_and_new_config_styles():
    assert rope_parameters({"rope_theta": 5.0})["rope_theta"] == 5.0
    assert rope_parameters({"rope_parameters": {"rope_theta": 7.0, "rope_type": "default"}}
                           )["rope_theta"] == 7.0


def test_llama3_rope_scaling_changes_only_low_frequencies():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    plain = RotaryEmbedding(64, 16, 500000.0)
    scaled = RotaryEmbedding(64, 16, 500000.0, scaling)
    # Position 1's angle is inv_freq itself: high frequencies (first dims) unchanged,
    # the lowest frequency divided by the factor.
    a_plain = torch.atan2(plain.sin[1], plain.cos[1])
    a_scaled = torch.atan2(scaled.sin[1], scaled.cos[1])
    assert torch.allclose(a_plain[:4], a_scaled[:4])
    assert torch.allclose(a_scaled[31], a_plain[31] / 8.0, rtol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_fused_cpu_ops_are_bit_identical_to_the_torch_ops(model, num_threads):
    """The fp32 CPU model picks `kernels.cpu_fused` at load; switching back to the torch ops
    must not change one bit of the hidden states or logits."""
    from pdserve.kernels import cpu_fused

    if cpu_fused.load_fused_kernels() is None or not cpu_fused.is_enabled():
        pytest.skip("fused CPU ops unavailable here")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("bit-identity is claimed for torch's AVX2 / AVX-512 kernels only")
    assert model.rotary.use_fused_cpu_ops and model.layers[0].mlp.use_fused_cpu_ops
    torch.manual_seed(0)
    ids = torch.randint(0, model.args.vocab_size, (97,))
    positions = torch.arange(97)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with torch.inference_mode():
            fused = model(ids, positions, [(None, None)] * 30, DenseCausalAttention())
            fused_logits = model.compute_logits(fused[-5:])
            model.set_fused_cpu_ops(False)
            assert not model.norm.use_fused_cpu_ops
            plain = model(ids, positions, [(None, None)] * 30, DenseCausalAttention())
            plain_logits = model.compute_logits(plain[-5:])
    finally:
        model.set_fused_cpu_ops(True)
        torch.set_num_threads(previous)
    assert torch.equal(fused, plain)
    assert torch.equal(fused_logits, plain_logits)


def test_fused_cpu_ops_in_bf16_are_torchs_bf16_ops():
    """A bf16 CPU model runs the fused ops too (their bf16 entry points): the same bits as
    torch's bf16 ops, hidden states and logits."""
    from pdserve.kernels import cpu_fused

    if cpu_fused.load_fused_kernels() is None or not cpu_fused.is_enabled():
        pytest.skip("fused CPU ops unavailable here")
    args = LlamaArgs(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6,
                     rope_theta=10000.0, rope_scaling=None, max_position_embeddings=16,
                     tie_word_embeddings=True, attention_bias=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(args)
    # The embeddings are built empty (the loader fills them): uninitialized memory may
    # hold NaNs.
    torch.nn.init.normal_(model.embed_tokens.weight)
    model = model.to(torch.bfloat16)
    model.rotary.to("cpu", torch.bfloat16)
    model.set_fused_cpu_ops(True)
    assert model.rotary.use_fused_cpu_ops and model.layers[0].mlp.use_fused_cpu_ops
    runs = []
    for fused in (True, False):
        model.set_fused_cpu_ops(fused)
        with torch.inference_mode():
            hidden = model(torch.tensor([1, 2, 3]), torch.arange(3), [(None, None)],
                           DenseCausalAttention())
            runs.append((hidden, model.compute_logits(hidden)))
    assert runs[0][0].shape == (3, 16) and runs[0][0].dtype == torch.bfloat16
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
