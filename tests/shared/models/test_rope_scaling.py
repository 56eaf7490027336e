"""Rope scaling types yarn, dynamic (NTK) and longrope against transformers (issue 34).

Tiny random checkpoints as in test_architectures.py (original_max_position_embeddings 64,
max_position_embeddings 256): greedy tokens equal transformers' `generate` alone, batched,
with prefix-cache hits and under preemption, prompt logprobs within 1e-4. yarn is static and
crosses its original length here. dynamic is the default rope within max_position_embeddings
(all the engine serves); longrope is served up to original_max_position_embeddings and refused
past it (`shared/models/rope_scaling.py` says why). The rows past those lengths equal
transformers' rotary for each position as the last of its forward pass.
"""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.shared.llm import LLM
from pdserve.shared.models.architectures import check_hf_config, check_model_dir
from pdserve.shared.models.rotary import RotaryEmbedding, rope_parameters
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.models.test_architectures import COMMON, build_checkpoint

pytestmark = pytest.mark.fp32_only  # the reference is transformers' fp32 model

ORIGINAL = 64
"""original_max_position_embeddings of yarn and longrope (dynamic's is MAX_POS)."""
MAX_POS = 256
MAX_TOKENS = 12
HALF = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.25 * i for i in range(HALF)],
            "long_factor": [2.0 + 1.5 * i for i in range(HALF)]}
FAMILIES = {
    # name: (transformers config class, its extra arguments, max_model_len)
    "yarn": ("LlamaConfig", {"max_position_embeddings": MAX_POS, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL}}, MAX_POS),
    "dynamic": ("LlamaConfig", {"max_position_embeddings": MAX_POS, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, MAX_POS),
    "longrope": ("Phi3Config", {"max_position_embeddings": MAX_POS,
                                "original_max_position_embeddings": ORIGINAL,
                                "sliding_window": None, "pad_token_id": 0,
                                "rope_parameters": LONGROPE}, ORIGINAL),
}
PROMPT_LENS = (5, 37, 50, 60, 200)
"""Each family takes those that fit its max_model_len with MAX_TOKENS more; yarn's 60 and
200 cross ORIGINAL."""


def greedy_params(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int = MAX_TOKENS):
    """transformers' greedy tokens (equal-length prompts), from a fresh rotary state
    (dynamic keeps grown frequencies between calls otherwise)."""
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.original_inv_freq.clone()
    rotary.max_seq_len_cached = rotary.original_max_seq_len
    with torch.inference_mode():
        out = model.generate(torch.tensor(prompts), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, len(prompts[0]):].tolist()


@pytest.fixture(scope="module")
def all_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint dir, transformers model, max_model_len)."""
    name = request.param
    config_class, extra, max_model_len = FAMILIES[name]
    directory = tmp_path_factory.mktemp(name)
    model = build_checkpoint(directory, config_class, **extra)
    return name, directory, model, max_model_len


def test_greedy_tokens_and_prompt_logprobs_equal_transformers(family, all_prompts):
    name, directory, model, max_model_len = family
    prompts = [p for p in all_prompts if len(p) + MAX_TOKENS <= max_model_len]
    want = [hf_generate(model, [p])[0] for p in prompts]
    llm = LLM(str(directory), kv_cache_memory="64MiB", max_model_len=max_model_len)
    alone = [llm.generate([p], greedy_params())[0].outputs[0].token_ids for p in prompts]
    assert alone == want, name
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy_params())]
    assert batched == want, name
    longest = prompts[-1]
    hit = llm.generate([longest], greedy_params())[0]
    assert hit.num_cached_tokens >= len(longest) // 16 * 16 - 16 > 0, name
    assert hit.outputs[0].token_ids == want[-1], name
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([longest])).logits[0, :-1], dim=-1)
    chosen = logprobs.gather(1, torch.tensor(longest[1:])[:, None]).squeeze(1)
    out = llm.generate([longest], greedy_params(prompt_logprobs=1))[0]
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)


def test_forced_preemption_keeps_the_tokens(family):
    """8 prompts of 30 tokens growing by 30 (60 < ORIGINAL: longrope's max_model_len) in a
    pool of 24 blocks: the growth preempts some, recomputed later."""
    name, directory, model, max_model_len = family
    g = torch.Generator().manual_seed(2)
    batch = [torch.randint(3, 49152, (30,), generator=g).tolist() for _ in range(8)]
    want = hf_generate(model, batch, max_new_tokens=30)
    llm = LLM(str(directory), num_gpu_blocks_override=24, max_model_len=max_model_len,
              enable_prefix_caching=False)
    outs = llm.generate(batch, greedy_params(max_tokens=30))
    assert [o.outputs[0].token_ids for o in outs] == want, name
    assert llm.engine.scheduler.num_preemptions > 0


def test_longrope_past_its_original_length_is_refused_in_one_line(tmp_path):
    import transformers

    config_class, extra, _ = FAMILIES["longrope"]
    config = getattr(transformers, config_class)(**{**COMMON, **extra},
                                                 architectures=["Phi3ForCausalLM"])
    config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    check_hf_config(cfg, ORIGINAL)
    message = (r"Phi3ForCausalLM with longrope past original_max_position_embeddings=64 .*"
               r"--max-model-len 64 or less")
    with pytest.raises(ValueError, match=message) as info:
        check_hf_config(cfg, ORIGINAL + 1)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message):
        check_model_dir(str(tmp_path), MAX_POS)  # what the engine and the CLI run
    # Phi3Config's default original length, 4096, when config.json has none at the top level
    del cfg["original_max_position_embeddings"]
    check_hf_config(cfg, 4096)
    with pytest.raises(ValueError, match="original_max_position_embeddings=4096"):
        check_hf_config(cfg, 4097)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_rows_past_the_original_length_are_transformers_decode_steps(name):
    """Row p is what transformers' rotary gives position p as the last position of its
    forward pass (a decode step): dynamic's NTK base of seq_len p + 1, one growth per step;
    longrope's long factors from ORIGINAL on. Not served (see the module docstring)."""
    import transformers

    config_class, extra, _ = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    rotary = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    num_rows, head_dim = MAX_POS + 40, COMMON["hidden_size"] // COMMON["num_attention_heads"]
    params = rope_parameters(config.to_dict())
    ours = RotaryEmbedding(head_dim, MAX_POS, 10000.0, params, num_rows=num_rows)
    x = torch.zeros(1)
    for p in range(num_rows):
        cos, sin = rotary(x, torch.tensor([[p]]))
        assert torch.equal(cos[0, 0], ours.cos[p]) and torch.equal(sin[0, 0], ours.sin[p]), p
    # the switch is at the boundary: before it, the rows of one frequency vector
    boundary, one = MAX_POS, None  # dynamic: the default rope
    if name == "longrope":
        boundary, one = ORIGINAL, {**params, "long_factor": params["short_factor"]}
    one = RotaryEmbedding(head_dim, MAX_POS, 10000.0, one, num_rows=num_rows)
    assert torch.equal(ours.cos[:boundary], one.cos[:boundary])
    assert not torch.equal(ours.cos[boundary], one.cos[boundary])


def test_phi3_configs_as_transformers_standardizes_them():
    """Phi-3 keeps original_max_position_embeddings at the top level (which wins, 4096 when
    absent) and may name longrope "su" or "yarn"."""
    rope = {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}
    params = rope_parameters({"model_type": "phi3", "rope_scaling": rope,
                              "original_max_position_embeddings": 2048})
    assert (params["rope_type"], params["original_max_position_embeddings"]) == \
        ("longrope", 2048)
    params = rope_parameters({"model_type": "phi3", "rope_scaling": {**rope, "type": "yarn"}})
    assert (params["rope_type"], params["original_max_position_embeddings"]) == \
        ("longrope", 4096)
    assert "original_max_position_embeddings" not in rope_parameters({"rope_theta": 5.0})


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_rotary_is_bit_identical_on_the_scaled_tables(name):
    """`kernels.cpu_fused.rotary_embedding` indexes the same tables (yarn's attention factor
    and longrope's long rows included)."""
    from pdserve.kernels import cpu_fused

    if cpu_fused.load_fused_kernels() is None or not cpu_fused.is_enabled():
        pytest.skip("fused CPU ops unavailable here")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("bit-identity is claimed for torch's AVX2 / AVX-512 kernels only")
    rope = FAMILIES[name][1]["rope_parameters"]
    params = rope_parameters({"rope_parameters": rope, "max_position_embeddings": MAX_POS,
                              "original_max_position_embeddings": ORIGINAL})
    rotary = RotaryEmbedding(2 * HALF, MAX_POS, 10000.0, params)
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, MAX_POS, (50,), generator=g)
    q, k = torch.randn(50, 4, 2 * HALF, generator=g), torch.randn(50, 2, 2 * HALF, generator=g)
    want_q, want_k = rotary.apply(q, k, rotary.prepare(positions))
    rotary.use_fused_cpu_ops = True
    got_q, got_k = rotary.apply(q.clone(), k.clone(), rotary.prepare(positions))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
