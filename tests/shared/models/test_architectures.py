"""Each supported architecture token for token against transformers (issue 34).

Tiny checkpoints are built here from transformers' own configuration and model classes with
random weights (2 layers, hidden 64, SmolLM2's tokenizer and vocabulary; ~25 MB each,
saved as safetensors). Greedy tokens of a random model diverge at once when any detail is
wrong (a norm, a bias, a rope variant), so equal tokens for prompts of 5-200 tokens prove
the architecture: alone, batched, with prefix-cache hits and under forced preemption; prompt
logprobs within 1e-4 of transformers' fp32 log-softmax. Unsupported parts are refused in one
line naming them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.shared.llm import LLM
from pdserve.shared.models.architectures import check_hf_config
from pdserve.shared.models.loader import load_model
from pdserve.shared.sampling_params import SamplingParams

pytestmark = pytest.mark.fp32_only  # the reference is transformers' fp32 model

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              initializer_range=0.2, bos_token_id=1, eos_token_id=2)
"""initializer_range 0.2: peaked logits, so that greedy ties are out of reach of rounding."""
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
FAMILIES = {
    # name: (transformers config class, its extra arguments)
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3-rope": ("LlamaConfig", {"tie_word_embeddings": False,
                                    "rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    # attention_bias: q/k/v and o biases; no GQA; head_dim apart from hidden / heads
    "llama-bias": ("LlamaConfig", {"attention_bias": True, "num_key_value_heads": 4,
                                   "head_dim": 48}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    # a window of 48 tokens on every layer: prompts of 5, 37 and 200 tokens end inside it,
    # across it and far past it, and the blocks out of it are freed as requests grow
    "mistral-window": ("MistralConfig", {"sliding_window": 48}),
    # Qwen2's windowed layers from max_window_layers on: one full layer, one local
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 40,
                                     "max_window_layers": 1, "tie_word_embeddings": False}),
    "phi3": ("Phi3Config", {"sliding_window": None, "pad_token_id": 0}),
    # Phi-3-mini-4k windows every layer (2047 tokens there)
    "phi3-window": ("Phi3Config", {"sliding_window": 40, "pad_token_id": 0}),
}
MAX_MODEL_LEN = 512
MAX_TOKENS = 12
PROMPT_LENS = (5, 37, 200)


def build_checkpoint(directory: Path, config_class: str, **extra) -> torch.nn.Module:
    """A random-weight checkpoint of `config_class` in `directory` (config, safetensors,
    SmolLM2's tokenizer and chat template); returns the transformers model."""
    import transformers

    from pdserve.shared.models.convert import resolve_model_path

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    source = Path(resolve_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, prompts, checkpoint_models):
    """(name, checkpoint dir, greedy reference tokens, prompt logprob reference)."""
    name = request.param
    config_class, extra = FAMILIES[name]
    directory = tmp_path_factory.mktemp(name)
    model = build_checkpoint(directory, config_class, **extra)
    with torch.inference_mode():
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                  for p in prompts]
        p = prompts[1]
        logprobs = torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(p[1:])[:, None]).squeeze(1)
    checkpoint_models[name] = model
    return name, directory, greedy, chosen


@pytest.fixture(scope="module")
def checkpoint_models() -> dict[str, torch.nn.Module]:
    """The transformers model of each family built so far (tiny: kept for references)."""
    return {}


def greedy_params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def test_greedy_tokens_and_prompt_logprobs_equal_transformers(family, prompts):
    name, directory, greedy, chosen = family
    llm = LLM(str(directory), kv_cache_memory="64MiB", max_model_len=MAX_MODEL_LEN)
    # alone, then all together (a mixed batch), then again (prefix-cache hits)
    alone = [llm.generate([p], greedy_params())[0].outputs[0].token_ids for p in prompts]
    assert alone == greedy, name
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy_params())]
    assert batched == greedy, name
    hit = llm.generate([prompts[2]], greedy_params())[0]
    assert hit.num_cached_tokens >= 192 and hit.outputs[0].token_ids == greedy[2], name
    out = llm.generate([prompts[1]], greedy_params(prompt_logprobs=1))[0]
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)


def test_forced_preemption_keeps_the_tokens(family, checkpoint_models):
    name, directory, _, _ = family
    model = checkpoint_models[name]
    # 8 prompts of 30 tokens growing by 50: 8 x 5 blocks of 16 tokens, in a pool of 24. All
    # are admitted (2 blocks each), then their growth preempts some (recomputed later); each
    # must still give transformers' tokens.
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


@pytest.mark.parametrize("cfg, message", [
    ({"architectures": ["Gemma3ForConditionalGeneration"]},
     "architecture 'Gemma3ForConditionalGeneration' is not supported"),
    ({"architectures": ["MambaForCausalLM"]}, "architecture 'MambaForCausalLM'"),
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75},
     "partial_rotary_factor=0.75"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "proportional",
                                                              "factor": 4.0}},
     "rope type 'proportional' of LlamaForCausalLM is not supported"),
    ({"architectures": ["LlamaForCausalLM"], "mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_parts_are_refused_in_one_line(cfg, message):
    with pytest.raises(ValueError, match=message) as info:
        check_hf_config(cfg)
    assert "\n" not in str(info.value)


def test_blocks_out_of_every_window_are_freed_as_requests_grow(tmp_path, prompts):
    """Mistral windows every layer: a request holds about window / block_size blocks however
    long it grows (the rest is the null block in its list), its tokens stay transformers',
    and a finished request frees everything. A model with a full layer frees nothing early."""
    window = 48
    model = build_checkpoint(tmp_path, "MistralConfig", sliding_window=window)
    prompt = prompts[2]  # 200 tokens, then 60 more
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(tmp_path), kv_cache_memory="64MiB", max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=64)  # a chunked prefill: windows inside the prompt too
    kv = llm.engine.kv_cache_manager
    assert kv.sliding_window == window
    held: list[int] = []
    step = llm.engine.step

    def step_and_count():
        out = step()
        ids = [b.block_id for blocks in kv.req_to_blocks.values() for b in blocks]
        held.append(sum(1 for i in ids if i != 0))
        kv.check_invariants()
        return out

    llm.engine.step = step_and_count
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60,
                                                ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want
    block_size = kv.block_size
    # the window's blocks, the one it starts in, and the chunk being computed
    assert max(held[3:-1]) <= window // block_size + 1 + 64 // block_size + 1, held
    assert max(held) < -(-(len(prompt) + 60) // block_size)
    assert kv.num_free_blocks == kv.block_pool.num_gpu_blocks - 1
    print("held blocks per step:", held)
    # a pool smaller than the request: served chunk by chunk inside the window
    small = LLM(str(tmp_path), num_gpu_blocks_override=12, max_model_len=MAX_MODEL_LEN)
    assert small.engine.scheduler.scheduler_config.long_prefill_token_threshold == 112
    out = small.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60,
                                                  ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want  # 260 tokens: 17 blocks, in a pool of 11


def test_only_a_model_windowed_on_every_layer_frees_blocks_early():
    from types import SimpleNamespace

    from pdserve.shared.engine.scheduling_policy import freeing_window

    def model(*windows):
        return SimpleNamespace(sliding_windows=windows)

    assert freeing_window(model(48, 48), None) == 48
    assert freeing_window(model(32, 64), None) == 64  # outside every layer's window
    assert freeing_window(model(None, 40), None) is None  # a full layer reads them all
    assert freeing_window(model(), None) is None
    draft = SimpleNamespace(method="draft_model")
    assert freeing_window(model(48, 48), draft) is None  # the draft reads the tables fully
    assert freeing_window(model(48, 48), SimpleNamespace(method="ngram")) == 48


def test_layer_windows_follow_transformers():
    from pdserve.shared.models.architectures import layer_sliding_windows

    assert layer_sliding_windows({"model_type": "mistral", "num_hidden_layers": 2,
                                  "sliding_window": 4096}) == (4096, 4096)
    # Qwen2.5 configs set a window but use_sliding_window false: full attention
    assert layer_sliding_windows({"model_type": "qwen2", "num_hidden_layers": 2,
                                  "sliding_window": 32768,
                                  "use_sliding_window": False}) == (None, None)
    assert layer_sliding_windows({"model_type": "qwen2", "num_hidden_layers": 3,
                                  "sliding_window": 64, "use_sliding_window": True,
                                  "max_window_layers": 1}) == (None, 64, 64)
    assert layer_sliding_windows({"num_hidden_layers": 2, "sliding_window": 8, "layer_types": [
        "full_attention", "sliding_attention"]}) == (None, 8)


def test_a_weight_the_model_has_no_place_for_is_refused(tmp_path):
    """A checkpoint with q/k/v biases under a config that says none: serving without them
    would give wrong tokens, so the load fails naming them (it warned before)."""
    build_checkpoint(tmp_path, "LlamaConfig", attention_bias=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["attention_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weights this LlamaForCausalLM model does not use.*"
                                         r"q_proj\.bias"):
        load_model(tmp_path)
