"""Read and validate a PEFT LoRA adapter directory into pdserve's fused layout (`LoRAModel`).

A PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`) holds, per targeted
module of each layer, lora_A [r, in] and lora_B [out, r] (Hu et al. 2021):

    y = W x + scale * B (A x),      scale = lora_alpha / r   (lora_alpha / sqrt(r): rsLoRA)

pdserve fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so the LoRAs of a fused
layer's parts are stacked (vLLM's `MergedColumnParallelLinearWithLoRA` does the same):

    qkv_proj (q and v targeted, rank r):     A = [A_q; A_v]            [2r, in]
                                             B = | B_q  0  |  rows q   [q + 2kv, 2r]
                                                 |  0   0  |  rows k
                                                 |  0  B_v |  rows v

A part not targeted contributes zero (it has no columns); `scale` is folded into B once here.
Anything beyond plain LoRA (DoRA, biases, modules_to_save, per-module ranks, ...) is refused
in one line, as are missing files, another base model's shapes and ranks over the maximum.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.shared.lora.request import LoRARequest

PEFT_MODULES: dict[str, tuple[str, str, int]] = {
    # PEFT name: (sub-module of the decoder layer, pdserve's fused linear, part index)
    "q_proj": ("self_attn", "qkv_proj", 0),
    "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
"""The PEFT target modules pdserve serves, and where their LoRA goes."""

_REFUSED_EXTRAS = ("use_dora", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern",
                   "layer_replication", "trainable_token_indices", "target_parameters",
                   "alora_invocation_tokens", "fan_in_fan_out", "use_qalora", "use_bdlora",
                   "megatron_config")
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])\.weight")


@dataclass(frozen=True, slots=True)
class FusedLinearShape:
    """Where a fused linear layer's parts lie in its output."""

    in_features: int
    part_sizes: tuple[int, ...]
    """Output rows of each part in order (q, k, v / gate, up / the whole layer)."""


@dataclass(slots=True)
class LoRALayerWeights:
    """One fused linear layer's LoRA (its targeted parts stacked), scale folded into B."""

    lora_a: torch.Tensor
    """[R, in] fp32: the targeted parts' A stacked (R = parts x rank)."""
    lora_b: torch.Tensor
    """[out, R] fp32: each part's B * scale in its rows and columns, zeros elsewhere."""


@dataclass(slots=True)
class LoRAModel:
    """A loaded adapter: per decoder layer, fused linear name -> its LoRA."""

    lora_request: LoRARequest
    rank: int
    scale: float
    layers: list[dict[str, LoRALayerWeights]]

    @property
    def num_bytes(self) -> int:
        return sum(w.lora_a.numel() * 4 + w.lora_b.numel() * 4
                   for layer in self.layers for w in layer.values())


def fused_linear_shapes(model) -> dict[str, FusedLinearShape]:
    """The shapes of the fused linears LoRA applies to, read from a loaded decoder's first
    layer (Llama-family and Gemma decoders share these names and attributes)."""
    layer = model.layers[0]
    attn, mlp, hidden = layer.self_attn, layer.mlp, model.args.hidden_size
    inter = mlp.intermediate_size
    return {"qkv_proj": FusedLinearShape(hidden, (attn.q_size, attn.kv_size, attn.kv_size)),
            "o_proj": FusedLinearShape(attn.q_size, (hidden,)),
            "gate_up_proj": FusedLinearShape(hidden, (inter, inter)),
            "down_proj": FusedLinearShape(inter, (hidden,))}


def _read_config(lora_request: LoRARequest, max_lora_rank: int) -> tuple[dict, list[str]]:
    path = Path(lora_request.lora_path)
    name = lora_request.lora_name
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: unreadable adapter_config.json: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not "
                         "supported (only LORA)")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={cfg['bias']!r} is not supported "
                         "(only 'none')")
    extras = [k for k in _REFUSED_EXTRAS if cfg.get(k)]
    if extras:
        raise ValueError(f"LoRA adapter {name!r}: {extras[0]}={cfg[extras[0]]!r} is not "
                         "supported (plain LoRA only)")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is over max_lora_rank="
                         f"{max_lora_rank} (--max-lora-rank)")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = list(PEFT_MODULES) if targets == "all-linear" else [targets]
    unknown = sorted(set(targets) - set(PEFT_MODULES))
    if unknown:
        raise ValueError(f"LoRA adapter {name!r}: target module {unknown[0]!r} is not "
                         f"supported (only {', '.join(PEFT_MODULES)})")
    return cfg, list(targets)


def load_peft_adapter(lora_request: LoRARequest, shapes: dict[str, FusedLinearShape],
                      num_layers: int, max_lora_rank: int) -> LoRAModel:
    """Read `lora_request.lora_path` into a `LoRAModel` for a decoder of these shapes.

    Raises:
        ValueError: one line naming what is wrong (missing file, unsupported feature or
            target module, rank over `max_lora_rank`, a shape of another base model).
    """
    name = lora_request.lora_name
    cfg, _ = _read_config(lora_request, max_lora_rank)
    rank = cfg["r"]
    alpha = float(cfg.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    weights_file = Path(lora_request.lora_path) / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors in "
                         f"{lora_request.lora_path}")
    parts: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
    with safe_open(str(weights_file), framework="pt") as f:
        for key in f.keys():
            m = _KEY.fullmatch(key)
            if m is None or m.group(3) not in PEFT_MODULES or \
                    PEFT_MODULES[m.group(3)][0] != m.group(2):
                raise ValueError(f"LoRA adapter {name!r}: weight {key!r} is not a LoRA of a "
                                 f"supported module ({', '.join(PEFT_MODULES)})")
            layer = int(m.group(1))
            if layer >= num_layers:
                raise ValueError(f"LoRA adapter {name!r}: {key!r} is past the model's "
                                 f"{num_layers} layers: an adapter of another base model")
            _, fused, part = PEFT_MODULES[m.group(3)]
            parts.setdefault((layer, fused), {}).setdefault(part, {})[m.group(4)] = \
                f.get_tensor(key).float()
    if not parts:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA "
                         "weights")
    layers: list[dict[str, LoRALayerWeights]] = [{} for _ in range(num_layers)]
    for (layer, fused), by_part in sorted(parts.items()):
        layers[layer][fused] = _stack_parts(name, layer, fused, by_part, shapes[fused],
                                            rank, scale)
    return LoRAModel(lora_request, rank, scale, layers)


def _stack_parts(name: str, layer: int, fused: str, by_part: dict[int, dict[str, torch.Tensor]],
                 shape: FusedLinearShape, rank: int, scale: float) -> LoRALayerWeights:
    """Stack one fused layer's targeted parts (see the module docstring's picture)."""
    out_features = sum(shape.part_sizes)
    targeted = sorted(by_part)
    lora_a = torch.zeros(len(targeted) * rank, shape.in_features)
    lora_b = torch.zeros(out_features, len(targeted) * rank)
    for col, part in enumerate(targeted):
        where = f"layer {layer} {fused} part {part}"
        ab = by_part[part]
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise ValueError(f"LoRA adapter {name!r}: {where} lacks lora_{missing}")
        a, b = ab["A"], ab["B"]
        size = shape.part_sizes[part]
        if tuple(a.shape) != (rank, shape.in_features) or tuple(b.shape) != (size, rank):
            raise ValueError(f"LoRA adapter {name!r}: {where} has A {list(a.shape)} and B "
                             f"{list(b.shape)}, the model needs [{rank}, {shape.in_features}] "
                             f"and [{size}, {rank}]: an adapter of another base model")
        row = sum(shape.part_sizes[:part])
        lora_a[col * rank:(col + 1) * rank] = a
        lora_b[row:row + size, col * rank:(col + 1) * rank] = b * scale
    return LoRALayerWeights(lora_a, lora_b)
