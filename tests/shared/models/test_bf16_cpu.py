"""--dtype bfloat16 on the CPU (issue 38): the weights held once as bf16 panels (half of
fp32's bytes), the engine's perplexity on tests/data within 1% of fp32's, batched output
equal to one request at a time, and greedy tokens against transformers' bf16 model."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_gemv
from pdserve.shared.llm import LLM
from pdserve.shared.sampling_params import SamplingParams
from tests.conftest import NUM_PARITY_TOKENS, transformers_greedy
from tests.shared.models.test_quantization import perplexity, text_ids  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.fp32_only]
KV_MEMORY = "128MiB"


@pytest.fixture(scope="module")
def bf16(model_path):
    return LLM(model_path, dtype="bfloat16", kv_cache_memory=KV_MEMORY, max_num_seqs=16)


@pytest.fixture(scope="module")
def fp32(model_path):
    return LLM(model_path, dtype="float32", kv_cache_memory=KV_MEMORY, max_num_seqs=16)


@pytest.mark.skipif(cpu_gemv.load_kernel(torch.bfloat16) is None,
                    reason="no AVX-512 or no C compiler: bf16 runs the torch ops")
def test_weights_are_held_once_in_bf16(bf16, fp32):
    m16, m32 = bf16.engine.model_runner.model, fp32.engine.model_runner.model
    held16 = sum(v for k, v in bf16.engine.memory_bytes().items() if k != "kv_cache")
    held32 = sum(v for k, v in fp32.engine.memory_bytes().items() if k != "kv_cache")
    assert m16.lm_head_gemv.wpacked.dtype == torch.bfloat16
    assert all(m.weight is None for m in m16.modules() if hasattr(m, "gemv") and m.gemv)
    assert 0.49 * held32 <= held16 <= 0.51 * held32, (held16, held32)
    assert m16.parameter_bytes() * 2 == m32.parameter_bytes()


def test_perplexity_within_one_percent_of_fp32(bf16, fp32, text_ids):  # noqa: F811
    text_ids = text_ids[:1024]  # lean: the Declaration's first 1,024 tokens
    ppl32, ppl16 = perplexity(fp32, text_ids), perplexity(bf16, text_ids)
    print(f"perplexity fp32 {ppl32:.4f} bf16 {ppl16:.4f} ratio {ppl16 / ppl32:.4f}")
    assert 5 < ppl32 < 50, ppl32
    assert abs(ppl16 / ppl32 - 1) <= 0.01, (ppl32, ppl16)


def test_batched_equals_alone(bf16, parity_prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [{"prompt_token_ids": ids} for ids in parity_prompt_ids]
    batched = [o.outputs[0].token_ids for o in bf16.generate(prompts, params)]
    alone = [bf16.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone


def test_greedy_parts_from_transformers_bf16_only_at_near_ties(bf16, model_path,
                                                               parity_prompt_ids):
    """bf16 rounds differently in any two implementations (another summation order, where
    the rounding to bf16 happens), so greedy paths may part where two logits lie within a
    few bf16 roundings (transformers' own torch-op path parts from its generate() too). At
    each prompt's first divergence, transformers' bf16 logit of the token pdserve chose must
    be within 2 bf16 steps of its top logit: a wrong kernel would choose far tokens."""
    from transformers import AutoModelForCausalLM

    tokens = min(16, NUM_PARITY_TOKENS)  # lean: transformers' bf16 generate is slow here
    ref = transformers_greedy(model_path, parity_prompt_ids, dtype="bfloat16",
                              max_tokens=tokens)
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    got = [o.outputs[0].token_ids
           for o in bf16.generate([{"prompt_token_ids": ids} for ids in parity_prompt_ids],
                                  params)]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    agree, gaps = [], []
    for ids, mine, theirs in zip(parity_prompt_ids, got, ref):
        n = 0
        while n < min(len(mine), len(theirs)) and mine[n] == theirs[n]:
            n += 1
        agree.append(n)
        if n == min(len(mine), len(theirs)):
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([ids + theirs[:n]])).logits[0, -1].float()
        top = logits.max()
        step = 2.0 ** (torch.floor(torch.log2(top.abs())) - 7)  # one bf16 ulp at the top
        gaps.append(round(float((top - logits[mine[n]]) / step), 2))
    print("bf16 tokens before the first divergence from transformers bf16:", agree,
          "gaps in bf16 steps:", gaps)
    assert all(g <= 2 for g in gaps), (agree, gaps)
    assert sum(agree) >= len(agree) * tokens // 3, agree


def test_bf16_panels_need_an_even_k():
    """bf16 panels pair the input features: a model with an odd K keeps plain bf16 layers
    (torch's matmul) instead of failing to load."""
    from pdserve.shared.models import weight_layout
    from pdserve.shared.models.llama import LlamaArgs, LlamaForCausalLM

    def model(intermediate_size: int) -> LlamaForCausalLM:
        cfg = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": intermediate_size,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
               "rms_norm_eps": 1e-5, "max_position_embeddings": 64}
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaArgs.from_hf_config(cfg))

    odd, even = model(33), model(34)
    assert not weight_layout.panels_fit(odd, torch.bfloat16)
    assert weight_layout.panels_fit(odd, torch.float32)
    assert weight_layout.panels_fit(even, torch.bfloat16)
