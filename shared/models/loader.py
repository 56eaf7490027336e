"""Load a Llama-family or Gemma model from a local HF directory (config.json + safetensors)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.kernels import cpu_fused, cpu_gemv, cpu_int8, cpu_int8_vnni, cpu_linear
from pdserve.shared.models import weight_cache, weight_layout
from pdserve.shared.models.gemma import GemmaArgs, GemmaForCausalLM
from pdserve.shared.models.gemma_config import is_gemma
from pdserve.shared.models.llama import LlamaArgs, LlamaForCausalLM

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_config(model_path: str | Path) -> dict:
    with open(Path(model_path) / "config.json") as f:
        return json.load(f)


def checkpoint_files(model_path: Path) -> list[Path]:
    """The safetensors files holding the checkpoint: those `model.safetensors.index.json`
    names when it exists (Mistral's repositories also ship `consolidated.safetensors`, the
    same weights under other names, beside the shards), else every `*.safetensors`.

    Raises:
        FileNotFoundError: no safetensors file, or one the index names is missing.
    """
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        files = [model_path / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names {missing[0]}, which is not in {model_path}")
    else:
        files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    return files


def _read_checkpoint(model_path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_path):
        with safe_open(str(path), framework="pt") as f:
            tensors.update((name, f.get_tensor(name)) for name in f.keys())
    return tensors


def load_model(model_path: str | Path, dtype: str = "float32", device: str = "cpu",
               quantization: str = "none") -> LlamaForCausalLM:
    """Build the model from `config.json` and fill it from the safetensors files.

    On the CPU in fp32 or bf16 with the panel kernels, or in int8, the weights are packed
    once per host into the weight cache and mapped read-only from it
    (`shared.models.weight_cache`; a second engine or a restart maps what the first packed);
    without the cache (PDSERVE_WEIGHT_CACHE=0, an unwritable directory) this process packs
    its own copy.
    `quantization="int8"` quantizes the linear layers, LM head and embeddings at load
    (`LlamaForCausalLM.quantize_int8`); it needs dtype float32 on the CPU.

    Raises:
        FileNotFoundError: no config or no weights.
        ValueError: unsupported architecture, a checkpoint missing a weight, or a
            quantization this build cannot run.
    """
    if quantization not in ("none", "int8"):
        raise ValueError(f"quantization must be 'none' or 'int8', got {quantization!r}")
    if quantization == "int8" and (dtype != "float32" or device != "cpu"):
        raise ValueError(f"quantization='int8' runs fp32 activations on the CPU; got "
                         f"dtype={dtype!r} device={device!r}")
    model_path = Path(model_path)
    int8 = quantization == "int8"
    cacheable = device == "cpu" and (int8 or (
        dtype in ("float32", "bfloat16") and cpu_linear.is_enabled()
        and weight_layout.panels_available(_DTYPES[dtype])))
    if cacheable and weight_cache.cache_dir() is not None:
        model = _load_cached(model_path, dtype, int8)
        if model is not None:
            return model.eval()
    model = _load_plain(model_path, dtype, device)
    if int8:
        model.quantize_int8()
    else:
        model.set_packed_linear(cpu_linear.is_enabled())
    return model.eval()


def _load_cached(model_path: Path, dtype: str, int8: bool) -> LlamaForCausalLM | None:
    """The CPU model with its panels (or int8 weights) mapped from the host's weight cache,
    packed first by this process if no engine of the host has; None when the cache cannot
    be used (logged: the caller packs privately)."""
    model = _build(read_hf_config(model_path))
    if not weight_layout.panels_fit(model, _DTYPES[dtype]):
        return None  # an odd K: bf16 stays plain (torch's bf16 matmul)
    files = checkpoint_files(model_path)
    variant = {"dtype": dtype, "quantization": "int8" if int8 else "none",
               "layout": weight_layout.LAYOUT_VERSION, "panel": cpu_gemv.PANEL}
    if int8:  # the int8 layout depends on the VNNI kernel being here
        variant["vnni"] = cpu_int8_vnni.load_kernel() is not None
        cpu_int8.load_kernel()  # compile once now, not in the first step

    def build() -> dict[str, torch.Tensor]:
        model = _load_plain(model_path, dtype, "cpu")
        if int8:
            model.quantize_int8()
            return weight_layout.pack_int8_weights(model)
        return weight_layout.pack_weights(model)

    key = weight_cache.cache_key(model_path, files, **variant)
    try:
        tensors, mapping = weight_cache.load_or_build(key, build)
    except OSError as e:
        logger.warning("weight cache not usable (%s): packing the weights in this process", e)
        return None
    (weight_layout.install_int8 if int8 else weight_layout.install_packed)(model, tensors)
    model.weight_mapping = mapping
    _finish(model, "cpu", _DTYPES[dtype])
    return model


def _build(cfg: dict) -> LlamaForCausalLM:
    """The model's modules on the meta device (no memory), to be given real tensors."""
    args = GemmaArgs.from_hf_config(cfg) if is_gemma(cfg) else LlamaArgs.from_hf_config(cfg)
    cls = GemmaForCausalLM if isinstance(args, GemmaArgs) else LlamaForCausalLM
    with torch.device("meta"):
        return cls(args)


def _finish(model: LlamaForCausalLM, device: str, torch_dtype: torch.dtype) -> None:
    """The rotary tables on `device`, and the fused CPU ops chosen."""
    if isinstance(model, GemmaForCausalLM):
        model.move_rotary(device, torch_dtype)
    else:
        model.rotary.to(device, torch_dtype)
    model.set_fused_cpu_ops(cpu_fused.is_enabled())


def _load_plain(model_path: Path, dtype: str, device: str) -> LlamaForCausalLM:
    """The model with its plain weights from the checkpoint, in `dtype` on `device`."""
    cfg = read_hf_config(model_path)
    ckpt = _read_checkpoint(model_path)

    def take(name: str) -> torch.Tensor:
        if name not in ckpt:
            raise ValueError(f"checkpoint {model_path} lacks weight {name!r}")
        return ckpt.pop(name)

    model = _build(cfg)
    state = _state_dict(model.args, take)
    ckpt.pop("lm_head.weight", None)  # tied checkpoints may still carry a copy
    leftover = [k for k in ckpt if "rotary_emb" not in k]
    if leftover:
        # NOTE: a weight this model has no place for is a part of the architecture it does
        # not implement (a bias, a norm): serving without it would give wrong tokens.
        arch = (cfg.get("architectures") or ["Llama"])[0]
        raise ValueError(f"checkpoint {model_path} has {len(leftover)} weights this {arch} "
                         f"model does not use, e.g. {leftover[:3]}")
    torch_dtype = _DTYPES[dtype]
    state = {k: v.to(device=device, dtype=torch_dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    _finish(model, device, torch_dtype)
    return model


def _plus_one(weight: torch.Tensor) -> torch.Tensor:
    """A Gemma norm weight w as the factor (1 + w) in fp32, as transformers computes it."""
    return 1.0 + weight.float()


def _state_dict(args: LlamaArgs | GemmaArgs, take: Callable[[str], torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under the model's names: q/k/v and gate/up stacked (one
    matmul each; a Phi-3 checkpoint stores them so), biases and norms as the config says, a
    Gemma's norm weights as (1 + w). `take(name)` pops a checkpoint weight (ValueError if
    missing)."""
    gemma = isinstance(args, GemmaArgs)
    norm = _plus_one if gemma else (lambda weight: weight)
    fused = not gemma and args.fused_checkpoint
    state = {"embed_tokens.weight": take("model.embed_tokens.weight"),
             "norm.weight": norm(take("model.norm.weight"))}
    if not args.tie_word_embeddings:
        state["lm_head_weight"] = take("lm_head.weight")
    norms = ["input_layernorm", "post_attention_layernorm"]
    if gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if args.qk_norm:
        norms += ["self_attn.q_norm", "self_attn.k_norm"]
    for i in range(args.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        att, mlp = p + "self_attn.", p + "mlp."
        state[q + "self_attn.qkv_proj.weight"] = (
            take(att + "qkv_proj.weight") if fused else
            torch.cat([take(att + f"{n}_proj.weight") for n in "qkv"], dim=0))
        if args.attention_bias:
            state[q + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(att + f"{n}_proj.bias") for n in "qkv"], dim=0)
        state[q + "self_attn.o_proj.weight"] = take(att + "o_proj.weight")
        if args.o_proj_bias:
            state[q + "self_attn.o_proj.bias"] = take(att + "o_proj.bias")
        state[q + "mlp.gate_up_proj.weight"] = (
            take(mlp + "gate_up_proj.weight") if fused else
            torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")], dim=0))
        state[q + "mlp.down_proj.weight"] = take(mlp + "down_proj.weight")
        for name in norms:
            state[q + name + ".weight"] = norm(take(p + name + ".weight"))
    return state
