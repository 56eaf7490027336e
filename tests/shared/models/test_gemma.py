"""Gemma 2 and Gemma 3 (text) token for token against transformers (issue 34).

Tiny random checkpoints as in test_architectures.py, with what makes Gemma differ switched
on and made to matter: head_dim 32 (hidden / heads is 16), query_pre_attn_scalar 24, random
(1 + w) norm weights (transformers initializes them to 0), local layers with a window of 32
tokens (prompts of 5, 37 and 200 tokens and preempted requests growing to 80 cross it),
Gemma 2's attention and final logit soft-caps, Gemma 3's own local / global ropes (the
global one linear-scaled) and untied LM head.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.shared.llm import LLM
from pdserve.shared.models.architectures import check_hf_config
from pdserve.shared.models.gemma_config import gemma_layer_types, gemma_rope_parameters
from pdserve.shared.models.layers import RMSNorm
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.models.test_architectures import (
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPT_LENS,
    build_checkpoint,
    greedy_params,
)

pytestmark = pytest.mark.fp32_only  # the reference is transformers' fp32 model

WINDOW = 32
GEMMA = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW)
FAMILIES = {
    # name: (transformers config class, its extra arguments)
    "gemma2": ("Gemma2Config", {**GEMMA, "attn_logit_softcapping": 8.0,
                                "final_logit_softcapping": 5.0}),
    "gemma3": ("Gemma3TextConfig", {
        **GEMMA, "num_hidden_layers": 3, "tie_word_embeddings": False,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}}),
}


def build_gemma_checkpoint(directory, config_class: str, **extra) -> torch.nn.Module:
    """`build_checkpoint` with random norm weights (saved again): Gemma's are (1 + w) and
    transformers initializes w to 0, which would hide a missing or doubled 1."""
    model = build_checkpoint(directory, config_class, **extra)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, prompts):
    """(name, checkpoint dir, transformers model, greedy reference, prompt logprob reference)."""
    name = request.param
    config_class, extra = FAMILIES[name]
    directory = tmp_path_factory.mktemp(name)
    model = build_gemma_checkpoint(directory, config_class, **extra)
    with torch.inference_mode():
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                  for p in prompts]
        p = prompts[2]  # 200 tokens: past the window
        logprobs = torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(p[1:])[:, None]).squeeze(1)
    return name, directory, model, greedy, chosen


def test_greedy_tokens_and_prompt_logprobs_equal_transformers(family, prompts):
    name, directory, _, greedy, chosen = family
    llm = LLM(str(directory), kv_cache_memory="64MiB", max_model_len=MAX_MODEL_LEN)
    model = llm.engine.model_runner.model
    assert model.sliding_windows == tuple(
        WINDOW if kind == "sliding_attention" else None
        for kind in FAMILIES[name][1].get("layer_types", ["sliding_attention",
                                                          "full_attention"]))
    # alone, then all together (a mixed batch), then again (prefix-cache hits)
    alone = [llm.generate([p], greedy_params())[0].outputs[0].token_ids for p in prompts]
    assert alone == greedy, name
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy_params())]
    assert batched == greedy, name
    hit = llm.generate([prompts[2]], greedy_params())[0]
    assert hit.num_cached_tokens >= 192 and hit.outputs[0].token_ids == greedy[2], name
    out = llm.generate([prompts[2]], greedy_params(prompt_logprobs=1))[0]
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)


def test_forced_preemption_keeps_the_tokens(family):
    name, directory, model, _, _ = family
    # as test_architectures: 8 prompts of 30 tokens growing by 50 (past the window) in a pool
    # of 24 blocks of 16 tokens: some are preempted and recomputed.
    g = torch.Generator().manual_seed(2)
    batch = [torch.randint(3, 49152, (30,), generator=g).tolist() for _ in range(8)]
    with torch.inference_mode():
        want = model.generate(torch.tensor(batch), max_new_tokens=50, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[:, 30:].tolist()
    llm = LLM(str(directory), num_gpu_blocks_override=24, max_model_len=MAX_MODEL_LEN,
              enable_prefix_caching=False)
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want, name
    assert llm.engine.scheduler.num_preemptions > 0


def test_int8_weights_run_and_keep_the_soft_cap(family, prompts):
    """--quantization int8 quantizes Gemma's linear layers and embeddings as Llama's (not
    exact: the tokens are not compared); the final soft-cap still bounds the logits."""
    name, directory, _, _, _ = family
    llm = LLM(str(directory), kv_cache_memory="64MiB", max_model_len=MAX_MODEL_LEN,
              quantization="int8", device="cpu")
    model = llm.engine.model_runner.model
    assert model.quantization == "int8"
    out = llm.generate([prompts[1]], greedy_params())[0].outputs[0].token_ids
    assert len(out) == MAX_TOKENS
    cap = FAMILIES[name][1].get("final_logit_softcapping")
    if cap is not None:
        logits = model.compute_logits(torch.randn(3, 64) * 100)
        assert logits.abs().max() <= cap


@pytest.mark.parametrize("fused", [False, True])
def test_one_plus_w_norm_is_bit_identical_to_transformers(fused):
    """Stored as 1 + w, pdserve's RMSNorm (torch and fused C paths) gives transformers'
    Gemma RMSNorm bit for bit in fp32."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    g = torch.Generator().manual_seed(4)
    reference = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(64, generator=g))
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1.0 + reference.weight.float())
    norm.use_fused_cpu_ops = fused
    x, residual = torch.randn(7, 64, generator=g) * 3, torch.randn(7, 64, generator=g)
    with torch.no_grad():
        assert torch.equal(norm(x.clone()), reference(x))
        normed, summed = norm(x.clone(), residual.clone())
        assert torch.equal(summed, residual + x)
        assert torch.equal(normed, reference(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_scale_is_transformers(dtype, tmp_path):
    """sqrt(hidden_size) rounded to the hidden dtype first, as transformers' tensor is."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    from pdserve.shared.models.gemma import GemmaArgs, GemmaForCausalLM

    reference = Gemma2TextScaledWordEmbedding(100, 48, 0, embed_scale=48 ** 0.5).to(dtype)
    args = GemmaArgs.from_hf_config({
        "architectures": ["Gemma2ForCausalLM"], "vocab_size": 100, "hidden_size": 48,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "head_dim": 16})
    model = GemmaForCausalLM(args)
    ids = torch.arange(100)
    with torch.no_grad():
        rows = reference.weight[ids]
        assert torch.equal(rows * model.embed_scale[dtype], reference(ids))


def test_old_configs_read_as_transformers_converts_them():
    """Configs without layer_types / with rope_local_base_freq (transformers 4) give the
    layer types and ropes transformers 5 derives from them."""
    import transformers

    old = dict(num_hidden_layers=8, sliding_window_pattern=4, rope_theta=5e5,
               rope_local_base_freq=1e3, rope_scaling={"rope_type": "linear", "factor": 8.0})
    new = transformers.Gemma3TextConfig(**old).to_dict()
    cfg = {"architectures": ["Gemma3ForCausalLM"], **old}
    assert list(gemma_layer_types(cfg)) == new["layer_types"]
    assert gemma_rope_parameters(cfg) == new["rope_parameters"]
    cfg2 = {"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 3}
    assert list(gemma_layer_types(cfg2)) == transformers.Gemma2Config(
        num_hidden_layers=3).layer_types


@pytest.mark.parametrize("cfg, message", [
    ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"},
     "Gemma2ForCausalLM with hidden_activation='gelu' is not supported"),
    ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
     "use_bidirectional_attention"),
    ({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2,
      "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}},
     "rope type 'yarn' of Gemma3ForCausalLM \\(full_attention layers\\)"),
    ({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2,
      "layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({"architectures": ["Gemma3ForCausalLM"], "text_config": {"num_hidden_layers": 2}},
     "text_config"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]},
     "architecture 'Gemma3ForConditionalGeneration' is not supported"),
])
def test_unsupported_gemma_parts_are_refused_in_one_line(cfg, message):
    with pytest.raises(ValueError, match=message) as info:
        check_hf_config(cfg)
    assert "\n" not in str(info.value)
