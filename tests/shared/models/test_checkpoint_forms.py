"""HF directories in the forms users have them (issue 34): weights sharded over several
safetensors files with a `model.safetensors.index.json`, and the chat template in
`chat_template.jinja` or inside `tokenizer_config.json` (older checkpoints). Tied and untied
embeddings are covered family by family in test_architectures.py (llama ties them, the others
do not) and in test_gguf_families.py (llama.cpp writes no output.weight when tied).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from pdserve.shared.llm import LLM
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.models.test_architectures import FAMILIES, build_checkpoint

pytestmark = pytest.mark.fp32_only  # the reference is transformers' fp32 model

MAX_TOKENS = 10
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2? Answer, then stop."}]


def test_sharded_safetensors_give_transformers_tokens(tmp_path):
    config_class, extra = FAMILIES["qwen2"]  # untied: two 12 MB embedding matrices
    model = build_checkpoint(tmp_path, config_class, **extra)
    (tmp_path / "model.safetensors").unlink()
    model.save_pretrained(tmp_path, max_shard_size="8MB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and all((tmp_path / s).is_file() for s in shards)
    # Mistral's repositories ship the same weights again, under their own names, beside the
    # shards: only the files the index names are the checkpoint
    from safetensors.torch import save_file

    save_file({"tok_embeddings.weight": torch.zeros(4, 4)},
              str(tmp_path / "consolidated.safetensors"))
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 49152, (23,), generator=g).tolist()
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(tmp_path), kv_cache_memory="64MiB", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == want


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_the_chat_template_is_read_from_either_file(tmp_path, where):
    """LLM.chat renders the checkpoint's own template, wherever the checkpoint keeps it, as
    transformers' AutoTokenizer.apply_chat_template does."""
    config_class, extra = FAMILIES["llama"]
    build_checkpoint(tmp_path, config_class, **extra)
    jinja = tmp_path / "chat_template.jinja"
    template = jinja.read_text()
    if where == "tokenizer_config.json":
        config_path = tmp_path / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = template
        config_path.write_text(json.dumps(config))
        jinja.unlink()
    want = list(AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert want[:3] == [1, 9690, 198]  # <|im_start|>system\n: SmolLM2's template
    llm = LLM(str(tmp_path), kv_cache_memory="64MiB", max_model_len=256)
    assert llm.tokenizer.chat_template == template
    out = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert out[0].prompt_token_ids == want
