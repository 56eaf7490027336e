"""SmolLM2-135M-Instruct (the default model) with two PEFT adapters: greedy tokens of the
parity prompts through `LLM`, batched with the base model, equal transformers + PEFT fp32."""

from __future__ import annotations

import pytest
import torch

from pdserve.shared.llm import LLM
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.lora.adapters import lora, make_adapter, peft_greedy

pytestmark = pytest.mark.fp32_only

MAX_TOKENS = 10


def test_smollm2_adapters_batched_with_the_base_model_equal_peft(model_path, parity_prompt_ids,
                                                                 tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = parity_prompt_ids[:2]
    adapters = {
        "all16": make_adapter(tmp_path / "all16", base, 16, ["q_proj", "k_proj", "v_proj",
                              "o_proj", "gate_proj", "up_proj", "down_proj"], seed=1, std=0.05),
        "qv8": make_adapter(tmp_path / "qv8", base, 8, ["q_proj", "v_proj"], seed=2, std=0.08),
    }
    want = {name: peft_greedy(base, path, prompts, MAX_TOKENS) for name, path in
            adapters.items()}
    want[None] = peft_greedy(base, None, prompts, MAX_TOKENS)
    assert want["all16"] != want[None] and want["qv8"] != want[None]
    del base
    llm = LLM(model_path, kv_cache_memory="256MiB", max_model_len=1024, enable_lora=True,
              max_loras=2)
    loras = {name: lora(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    names = [*adapters, None]
    outs = llm.generate([p for _ in names for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        lora_request=[loras.get(n) for n in names for _ in prompts])
    assert [o.outputs[0].token_ids for o in outs] == [t for n in names for t in want[n]]
