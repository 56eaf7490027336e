"""PEFT adapters made for the LoRA tests, and transformers + PEFT fp32 greedy references.

PEFT initializes B to zero (an adapter that changes nothing); these set A and B random and
non-zero, so a wrong slice, scale or slot changes the greedy tokens of the tiny random model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from pdserve.shared.lora.request import LoRARequest


def make_adapter(directory: Path, base: torch.nn.Module, rank: int, targets: list[str],
                 seed: int, use_rslora: bool = False, alpha: int | None = None,
                 std: float = 0.15, **extra) -> Path:
    """Save a PEFT LoRA adapter of `base` (not modified) with random A and B."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets,
                        use_rslora=use_rslora, lora_dropout=0.0, **extra)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * std)
    peft_model.save_pretrained(directory)
    return directory


def peft_greedy(base: torch.nn.Module, adapter: Path | None, prompts: list[list[int]],
                max_tokens: int) -> list[list[int]]:
    """transformers + PEFT fp32 greedy tokens of each prompt (no adapter: the base model)."""
    model = base
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter)).eval()
    with torch.inference_mode():
        return [model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_tokens,
                               do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def lora(name: str, lora_id: int, path: Path) -> LoRARequest:
    return LoRARequest(name, lora_id, str(path))
