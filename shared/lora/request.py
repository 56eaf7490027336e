"""LoRARequest: which adapter a request runs under (vLLM's `vllm.lora.request.LoRARequest`
names), from the gateway's `model` field down to the engine's LoRA slots."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter (Hu et al. 2021) as a request names it.

    Attributes:
        lora_name: the name clients put in `model` (unique per deployment).
        lora_int_id: a positive id, unique per loaded adapter; 0 is the base model.
        lora_path: the PEFT adapter directory (`adapter_config.json` +
            `adapter_model.safetensors`), readable by the engine that loads it.
        base_model_name: the served model it adapts (vLLM's JSON `--lora-modules` form);
            None: the engine's model.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
