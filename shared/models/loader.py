"""Load a Llama-family or Gemma model from a local HF directory (config.json + safetensors)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.kernels import cpu_fused, cpu_linear
from pdserve.shared.models.gemma import GemmaArgs, GemmaForCausalLM, gemma_state_dict
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
    files = checkpoint_files(model_path)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def args_arch(model_path: Path) -> str:
    return (read_hf_config(model_path).get("architectures") or ["Llama"])[0]


def load_model(model_path: str | Path, dtype: str = "float32", device: str = "cpu",
               quantization: str = "none") -> LlamaForCausalLM:
    """Build the model from `config.json` and fill it from the safetensors files.

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
    cfg = read_hf_config(model_path)
    ckpt = _read_checkpoint(model_path)

    def take(name: str) -> torch.Tensor:
        if name not in ckpt:
            raise ValueError(f"checkpoint {model_path} lacks weight {name!r}")
        return ckpt.pop(name)

    if is_gemma(cfg):
        gemma_args = GemmaArgs.from_hf_config(cfg)
        with torch.device("meta"):
            gemma = GemmaForCausalLM(gemma_args)
        return _finish_loading(gemma, gemma_state_dict(gemma_args, take), ckpt, model_path,
                               dtype, device, quantization)
    args = LlamaArgs.from_hf_config(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    state: dict[str, torch.Tensor] = {}
    state["embed_tokens.weight"] = take("model.embed_tokens.weight")
    state["norm.weight"] = take("model.norm.weight")
    if not args.tie_word_embeddings:
        state["lm_head_weight"] = take("lm_head.weight")
    for i in range(args.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        att = p + "self_attn."
        state[q + "self_attn.qkv_proj.weight"] = (
            take(att + "qkv_proj.weight") if args.fused_checkpoint else
            torch.cat([take(att + f"{n}_proj.weight") for n in "qkv"], dim=0))
        if args.attention_bias:
            state[q + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(att + f"{n}_proj.bias") for n in "qkv"], dim=0)
        state[q + "self_attn.o_proj.weight"] = take(att + "o_proj.weight")
        if args.o_proj_bias:
            state[q + "self_attn.o_proj.bias"] = take(att + "o_proj.bias")
        if args.qk_norm:
            state[q + "self_attn.q_norm.weight"] = take(att + "q_norm.weight")
            state[q + "self_attn.k_norm.weight"] = take(att + "k_norm.weight")
        state[q + "mlp.gate_up_proj.weight"] = (
            take(p + "mlp.gate_up_proj.weight") if args.fused_checkpoint else
            torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")],
                      dim=0))
        state[q + "mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
        state[q + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        state[q + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    return _finish_loading(model, state, ckpt, model_path, dtype, device, quantization)


def _finish_loading(model: LlamaForCausalLM, state: dict[str, torch.Tensor],
                    ckpt: dict[str, torch.Tensor], model_path: Path, dtype: str, device: str,
                    quantization: str) -> LlamaForCausalLM:
    """Refuse checkpoint weights left unused, then fill the meta-built `model` from `state`
    on `device` in `dtype` and choose its CPU fast paths (or int8)."""
    ckpt.pop("lm_head.weight", None)  # tied checkpoints may still carry a copy
    leftover = [k for k in ckpt if "rotary_emb" not in k]
    if leftover:
        # NOTE: a weight this model has no place for is a part of the architecture it does
        # not implement (a bias, a norm): serving without it would give wrong tokens.
        raise ValueError(f"checkpoint {model_path} has {len(leftover)} weights this "
                         f"{args_arch(model_path)} model does not use, e.g. {leftover[:3]}")
    torch_dtype = _DTYPES[dtype]
    state = {k: v.to(device=device, dtype=torch_dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if isinstance(model, GemmaForCausalLM):
        model.move_rotary(device, torch_dtype)
    else:
        model.rotary.to(device, torch_dtype)
    model.set_fused_cpu_ops(cpu_fused.is_enabled())
    if quantization == "int8":
        model.quantize_int8()
    else:
        model.set_packed_linear(cpu_linear.is_enabled())
    return model.eval()
