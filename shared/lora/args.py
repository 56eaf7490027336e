"""The engine's LoRA flags (vLLM's spellings: --enable-lora, --max-loras, --max-lora-rank,
--max-cpu-loras) and the `LoRAConfig` they make; `EngineArgs` carries the fields."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pdserve.shared.config import LoRAConfig

MAX_LORA_RANK = 64
"""The largest --max-lora-rank accepted."""


def add_lora_cli_args(group: argparse._ArgumentGroup, env: Callable,
                      env_bool: Callable[[str, bool], bool]) -> None:
    """Add the flags to `group`; `env(name, default)` / `env_bool` read PDSERVE_<NAME>."""
    group.add_argument("--enable-lora", action="store_true",
                       default=env_bool("enable_lora", False),
                       help="serve LoRA adapters (PEFT directories) on top of the model")
    group.add_argument("--max-loras", type=int, default=int(env("max_loras", 1)),
                       help="adapters one step can serve (the rest of their requests wait)")
    group.add_argument("--max-lora-rank", type=int, default=int(env("max_lora_rank", 16)),
                       help=f"largest adapter rank accepted (at most {MAX_LORA_RANK})")
    group.add_argument("--max-cpu-loras", type=int, default=env("max_cpu_loras", None),
                       help="adapters kept loaded in memory, least recently used evicted "
                            "(default: --max-loras)")


def create_lora_config(enable_lora: bool, max_loras: int, max_lora_rank: int,
                       max_cpu_loras: int | None) -> LoRAConfig | None:
    """The frozen config, None without --enable-lora.

    Raises:
        ValueError: naming the flag that is out of range.
    """
    if not enable_lora:
        return None
    if max_loras < 1:
        raise ValueError(f"max_loras must be >= 1, got {max_loras}")
    if not 1 <= max_lora_rank <= MAX_LORA_RANK:
        raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {max_lora_rank}")
    if max_cpu_loras is not None and int(max_cpu_loras) < max_loras:
        raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
    return LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank,
                      max_cpu_loras=None if max_cpu_loras is None else int(max_cpu_loras))
