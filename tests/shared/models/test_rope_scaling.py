"""Rope scaling types yarn, dynamic (NTK) and longrope against transformers (issue 34).

Tiny random checkpoints as in test_architectures.py (original_max_position_embeddings 64,
max_position_embeddings 256): greedy tokens equal transformers' `generate` alone, batched,
with prefix-cache hits and under preemption, prompt logprobs within 1e-4. yarn is static and
crosses its original length here. dynamic is the default rope within max_position_embeddings
(all the engine serves). longrope is served past original_max_position_embeddings as
transformers' `generate` does (shared/engine/longrope.py): prompts that stay short, that
cross it while generating (the cache recomputed long) and that are long from the start,
batched together, with cache hits that never mix long and short KV, under preemption. The
rows past those lengths equal transformers' rotary for each position as the last of its
forward pass; longrope's long rows of the positions below it, as in a longer forward pass.
"""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.shared.engine.spec_decode.scheduling import num_spec_tokens
from pdserve.shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens
from pdserve.shared.llm import LLM
from pdserve.shared.models.architectures import check_hf_config, check_model_dir
from pdserve.shared.models.rotary import RotaryEmbedding, rope_parameters
from pdserve.shared.request import Request
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
                                "rope_parameters": LONGROPE}, MAX_POS),
}
PROMPT_LENS = (5, 37, 50, 60, 200)
"""Each family takes those that fit its max_model_len with MAX_TOKENS more; 60 and 200 cross
ORIGINAL (yarn, longrope): 60 while generating, 200 from the start."""


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
    """8 prompts of 30 tokens growing by 30 in a pool of 24 blocks: the growth preempts some,
    recomputed later. longrope's prompts have 50 tokens, and all cross ORIGINAL."""
    name, directory, model, max_model_len = family
    g = torch.Generator().manual_seed(2)
    prompt_len = 50 if name == "longrope" else 30
    batch = [torch.randint(3, 49152, (prompt_len,), generator=g).tolist() for _ in range(8)]
    want = hf_generate(model, batch, max_new_tokens=30)
    llm = LLM(str(directory), num_gpu_blocks_override=24, max_model_len=max_model_len,
              enable_prefix_caching=False)
    outs = llm.generate(batch, greedy_params(max_tokens=30))
    assert [o.outputs[0].token_ids for o in outs] == want, name
    assert llm.engine.scheduler.num_preemptions > 0


def test_longrope_past_its_original_length_is_accepted(tmp_path):
    import transformers

    config_class, extra, _ = FAMILIES["longrope"]
    config = getattr(transformers, config_class)(**{**COMMON, **extra},
                                                 architectures=["Phi3ForCausalLM"])
    config.save_pretrained(tmp_path)
    check_hf_config(json.loads((tmp_path / "config.json").read_text()), MAX_POS)
    check_model_dir(str(tmp_path), MAX_POS)  # what the engine and the CLI run
    check_model_dir(str(tmp_path))


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
    if name == "longrope":  # row num_rows + p: position p of a forward pass past ORIGINAL
        assert ours.long_rows == (ORIGINAL, num_rows) and len(ours.cos) == num_rows + ORIGINAL
        for p in range(ORIGINAL):
            cos, sin = rotary(x, torch.tensor([[p, ORIGINAL]]))
            row = num_rows + p
            assert torch.equal(cos[0, 0], ours.cos[row]) and torch.equal(sin[0, 0], ours.sin[row])
    else:
        assert ours.long_rows is None and len(ours.cos) == num_rows


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
    # and the start-up check accepts "su" for Phi-3 only (a tryout saw it refused)
    from pdserve.shared.models.architectures import check_hf_config

    check_hf_config({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                     "rope_scaling": rope})
    with pytest.raises(ValueError, match="rope type 'su' of LlamaForCausalLM"):
        check_hf_config({"architectures": ["LlamaForCausalLM"], "rope_scaling": rope})


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
    positions = torch.randint(0, len(rotary.cos), (50,), generator=g)  # longrope's long rows
    q, k = torch.randn(50, 4, 2 * HALF, generator=g), torch.randn(50, 2, 2 * HALF, generator=g)
    want_q, want_k = rotary.apply(q, k, rotary.prepare(positions))
    rotary.use_fused_cpu_ops = True
    got_q, got_k = rotary.apply(q.clone(), k.clone(), rotary.prepare(positions))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    """(checkpoint dir, transformers model) of the longrope family."""
    config_class, extra, _ = FAMILIES["longrope"]
    directory = tmp_path_factory.mktemp("longrope-hits")
    return directory, build_checkpoint(directory, config_class, **extra)


def test_longrope_cache_hits_never_mix_long_and_short_kv(longrope):
    """Long KV hashes apart from short KV of the same tokens (`b"rope=long"`): a short prompt
    sharing a long one's prefix computes its own blocks, and a long prompt sharing a short
    one's hits only long blocks; a prompt crossing ORIGINAL while generating hits its own
    short blocks again; one of exactly ORIGINAL tokens crosses at its first output (its
    cache dropped at once). Tokens equal transformers' `generate` throughout."""
    directory, model = longrope
    g = torch.Generator().manual_seed(4)
    long_prompt = torch.randint(3, 49152, (150,), generator=g).tolist()
    short_prompt = long_prompt[:40]
    long_again = short_prompt + torch.randint(3, 49152, (100,), generator=g).tolist()
    crossing = torch.randint(3, 49152, (60,), generator=g).tolist()
    at_original = torch.randint(3, 49152, (ORIGINAL,), generator=g).tolist()
    llm = LLM(str(directory), kv_cache_memory="64MiB", max_model_len=MAX_POS)

    def run(prompt: list[int], num_cached: int) -> None:
        out = llm.generate([prompt], greedy_params())[0]
        assert out.outputs[0].token_ids == hf_generate(model, [prompt])[0], len(prompt)
        assert out.num_cached_tokens == num_cached, len(prompt)

    run(long_prompt, 0)
    run(short_prompt, 0)  # the long prompt's first two blocks hold long KV
    run(short_prompt, 32)
    run(long_again, 32)  # the long prompt's, not the short one's
    kv = llm.engine.scheduler.kv_cache_manager
    short, long = (hash_request_tokens(short_prompt[:32], 16, block_extra_keys(
        llm.engine.model_config.served_model_name, None, "none", rope_long))
        for rope_long in (False, True))
    assert short != long and all(kv.block_pool.get_cached_block(h) for h in short + long)
    run(crossing, 0)
    run(crossing, 48)  # the blocks of its short prompt, computed before it crossed
    run(at_original, 0)


def test_longrope_drafts_stop_at_the_original_length():
    """A short request scores no draft position from ORIGINAL on (its logits there come from
    the long factors, after the recompute); a long one scores them all."""
    request = Request("r", list(range(ORIGINAL - 3)), greedy_params())
    request.num_computed_tokens = request.num_tokens - 1
    request.spec_token_ids = [1, 2, 3, 4, 5]
    assert num_spec_tokens(request, 1, 100) == 5
    assert num_spec_tokens(request, 1, 100, ORIGINAL) == 3
    request.rope_long = True
    assert num_spec_tokens(request, 1, 100, ORIGINAL) == 5
