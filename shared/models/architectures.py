"""Which HF checkpoints pdserve serves exactly, checked from config.json alone (no torch).

A checkpoint whose architecture, rope type or attention variant pdserve does not implement
is refused with one line naming it, before any weight is read or any service starts
(`EngineArgs.create_engine_configs` runs `check_hf_config`), never served with wrong tokens.
Each supported architecture is proven token for token against transformers on a tiny random
checkpoint built from transformers' own classes (tests/shared/models/test_architectures.py).
Names follow vLLM's `vllm/model_executor/models/` registry.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.shared.models.gemma_config import GEMMA_ARCHITECTURES, check_gemma_config

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "Llama 2/3.x, SmolLM2 (rope: default, linear, llama3, yarn, dynamic)",
    "MistralForCausalLM": "Mistral (sliding-window attention)",
    "Qwen2ForCausalLM": "Qwen2 / Qwen2.5 (q/k/v bias)",
    "Qwen3ForCausalLM": "Qwen3 (per-head q/k RMSNorm)",
    "Phi3ForCausalLM": "Phi-3 / Phi-3.5 (fused qkv and gate_up weights; rope default or "
                       "longrope)",
    "Gemma2ForCausalLM": "Gemma 2 ((1 + w) norms, GeGLU, attention and final logit "
                         "soft-capping, alternating local / global layers)",
    "Gemma3ForCausalLM": "Gemma 3 text-only, e.g. gemma-3-1b ((1 + w) norms, GeGLU, q/k "
                         "norms, local / global layers with their own rope)",
}
"""Architecture (config.json's `architectures[0]`) -> what it covers."""

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
"""`rope_scaling.rope_type` values `shared/models/rope_scaling.py` computes as transformers
does (longrope past original_max_position_embeddings too: shared/engine/longrope.py)."""


def rope_type(cfg: dict) -> str:
    """The rope type of an HF config (transformers 5's `rope_parameters` or the older
    `rope_scaling`; "default" when neither names one). Early Phi-3-128k configs name
    longrope "su", which transformers reads as longrope (and so does rope_scaling.py)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    kind = str(params.get("rope_type") or params.get("type") or "default")
    phi3 = (cfg.get("model_type") == "phi3"
            or (cfg.get("architectures") or [""])[0] == "Phi3ForCausalLM")
    return "longrope" if kind == "su" and phi3 else kind


def layer_sliding_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each layer's attention window in tokens (None: full attention), as transformers
    applies them: config `layer_types` ("sliding_attention" layers take `sliding_window`)
    when present; else Qwen2 / Qwen3 window the layers from `max_window_layers` on, and only
    with `use_sliding_window`; other families (Mistral) window every layer when
    `sliding_window` is set."""
    num_layers = int(cfg.get("num_hidden_layers") or 0)
    window = cfg.get("sliding_window")
    if not window:
        return (None,) * num_layers
    window = int(window)
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if cfg.get("model_type") in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window"):
            return (None,) * num_layers
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers


def check_hf_config(cfg: dict, max_model_len: int | None = None) -> None:
    """Raise ValueError, in one line naming the part, for a checkpoint pdserve would not
    serve exactly.

    Args:
        cfg: the checkpoint's config.json.
        max_model_len: the engine's, or None when not known yet. No check depends on it
            now (longrope is served past its original length: shared/engine/longrope.py).

    Raises:
        ValueError: an architecture not in SUPPORTED_ARCHITECTURES, a rope type not in
            SUPPORTED_ROPE_TYPES, MLP biases or partial rotary embeddings.
    """
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    kind = rope_type(cfg)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} of {arch} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{arch} with mlp_bias=true is not supported")
    if arch in GEMMA_ARCHITECTURES:
        check_gemma_config(cfg)
    partial = float((cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"{arch} with partial_rotary_factor={partial} (rotary on part of "
                         "each head) is not supported")


def check_model_dir(model: str, max_model_len: int = 0) -> None:
    """`check_hf_config` for a model given as a local HF directory or a .gguf file (from its
    header alone, before any conversion: `gguf_check.check_gguf`); a name is checked when it
    is loaded. `max_model_len` 0 means the engine's default (the model's
    max_position_embeddings, at most 8192). Raises ValueError as it does."""
    if str(model).endswith(".gguf") and Path(model).is_file():
        from pdserve.shared.models.gguf_check import check_gguf

        check_gguf(model, max_model_len)
        return
    config = Path(model) / "config.json"
    if not config.is_file():
        return
    cfg = json.loads(config.read_text())
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    check_hf_config(cfg, max_model_len or min(max_pos, 8192))
