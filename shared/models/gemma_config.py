"""What a Gemma 2 / Gemma 3 (text) config.json says beyond Llama's numbers, read without torch.

Both config generations are read: transformers 5 writes `layer_types` and (Gemma 3) one
`rope_parameters` entry per layer type; older configs leave the layer types to a pattern
(Gemma 2 alternates local and global layers; Gemma 3 makes every `sliding_window_pattern`-th
layer global) and keep the local rope base in `rope_local_base_freq`.
"""

from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
"""The Gemma architectures `shared/models/gemma.py` serves (text-only Gemma 3: its
`Gemma3ForConditionalGeneration` checkpoints with a vision tower are not among them)."""

GEMMA_ROPE_TYPES = ("default", "linear")
"""The rope types of Gemma 2 / 3 checkpoints (Gemma 3's global layers: linear scaling), which
`RotaryEmbedding` tables hold exactly."""

SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
"""`hidden_activation` values of the GeGLU MLP that gemma.py computes (all Gemma 2 / 3)."""


def is_gemma(cfg: dict) -> bool:
    return (cfg.get("architectures") or [""])[0] in GEMMA_ARCHITECTURES


def is_gemma3(cfg: dict) -> bool:
    return (cfg.get("architectures") or [""])[0] == "Gemma3ForCausalLM"


def gemma_layer_types(cfg: dict) -> tuple[str, ...]:
    """Each layer's type, SLIDING (local) or FULL (global), as transformers builds them."""
    num_layers = int(cfg.get("num_hidden_layers") or 0)
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    period = 2  # Gemma 2: local, global, local, ...
    if is_gemma3(cfg):
        period = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                     or 6)
    return tuple(SLIDING if (i + 1) % period else FULL for i in range(num_layers))


def gemma_sliding_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each layer's attention window in tokens (None: full attention)."""
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    return tuple(window if kind == SLIDING else None for kind in gemma_layer_types(cfg))


def gemma_rope_parameters(cfg: dict) -> dict[str, dict]:
    """Layer type -> its rope parameters (`rope_theta`, `rope_type`, scaling fields).

    Gemma 2 has one rope for all layers; Gemma 3 a local one (base 10^4, unscaled) and a
    global one (base 10^6, possibly `linear`-scaled), transformers' defaults.
    """
    nested = cfg.get("rope_parameters") or {}
    if not is_gemma3(cfg):
        params = {**(cfg.get("rope_scaling") or {}), **nested}
        params.setdefault("rope_theta", float(cfg.get("rope_theta") or 10000.0))
        return {SLIDING: params, FULL: params}
    if SLIDING in nested or FULL in nested:  # transformers 5
        full = dict(nested.get(FULL) or {})
        local = dict(nested.get(SLIDING) or {})
    else:
        full = {**(cfg.get("rope_scaling") or {}), **nested}
        local = {"rope_type": "default"}
    full.setdefault("rope_theta", float(cfg.get("rope_theta") or 1_000_000.0))
    local.setdefault("rope_theta", float(cfg.get("rope_local_base_freq") or 10_000.0))
    return {SLIDING: local, FULL: full}


def _rope_type(params: dict) -> str:
    return str(params.get("rope_type") or params.get("type") or "default")


def check_gemma_config(cfg: dict) -> None:
    """Raise ValueError, in one line naming the part, for a Gemma config gemma.py would not
    compute exactly (the checks Llama's families share are `check_hf_config`'s)."""
    arch = cfg["architectures"][0]
    if "text_config" in cfg:
        raise ValueError(f"{arch} config with a text_config (a multimodal checkpoint) is not "
                         "supported: serve its text-only checkpoint")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{arch} with hidden_activation={activation!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention=true (an embedding model) "
                         "is not supported")
    kinds = gemma_layer_types(cfg)
    if len(kinds) != int(cfg.get("num_hidden_layers") or 0) or set(kinds) - {SLIDING, FULL}:
        raise ValueError(f"{arch} layer_types {list(kinds)} are not one of {SLIDING!r} / "
                         f"{FULL!r} per layer")
    for kind, params in gemma_rope_parameters(cfg).items():
        if _rope_type(params) not in GEMMA_ROPE_TYPES:
            raise ValueError(f"rope type {_rope_type(params)!r} of {arch} ({kind} layers) is "
                             f"not supported (supported: {', '.join(GEMMA_ROPE_TYPES)})")
