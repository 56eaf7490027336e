"""Write a transformers model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does
(tests only): its tensor names (`blk.N.attn_q.weight`, ...), its metadata keys, its Q/K row
permutation for the llama architecture, Gemma's norms stored as 1 + w, Llama 3's rope scaling
as a `rope_freqs` tensor, and SmolLM2's tokenizer (gpt2-style BPE) as llama.cpp wrote it into
SmolLM2's own GGUF.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import torch

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3"}
"""transformers model_type -> the GGUF architecture llama.cpp writes it as."""


@cache
def smollm2_tokenizer_metadata() -> dict:
    """The tokenizer.* metadata of SmolLM2's GGUF (vocabulary and merges decoded)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    from pdserve.shared.models.convert import find_smollm2_gguf

    metadata, _ = read_gguf_metadata(str(find_smollm2_gguf()),
                                     ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (rotary halves -> interleaved pairs, per head)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama 3 rope scaling: what each inv_freq is divided by."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_gguf(model: torch.nn.Module, path: Path, *, arch: str | None = None,
               name: str = "tiny", quant: gguf.GGMLQuantizationType | None = None) -> Path:
    """Write `model` (a transformers *ForCausalLM) to `path` as llama.cpp would.

    Args:
        arch: general.architecture; default: llama.cpp's for the model's type.
        name: general.name ("mistral" makes transformers load a llama file as Mistral).
        quant: the type of the 2-D weights (Q8_0, Q4_1, ...: see `roundtrip`); None: F32.
            Norms and rope factors stay F32, as llama.cpp keeps them.
    """
    cfg = model.config
    arch = arch or GGUF_ARCH[cfg.model_type]
    heads, kv_heads, hidden = (cfg.num_attention_heads, cfg.num_key_value_heads,
                               cfg.hidden_size)
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    rope = dict(cfg.rope_parameters or {})
    rope = dict(rope.get("full_attention") or rope)  # Gemma 3: the file's rope is the global
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{quant.name}") if quant is not None
                    else gguf.LlamaFileType.ALL_F32)
    if "head_dim" in cfg.to_diff_dict() or head_dim != hidden // heads:
        w.add_key_length(head_dim)  # llama.cpp: whenever config.json names head_dim
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "phi3":
        w.add_rope_dimension_count(int(getattr(cfg, "partial_rotary_factor", 1.0) * head_dim))
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    _add_tokenizer(w)
    tensors = {}
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(rope, head_dim)
    if rope.get("rope_type") == "longrope":  # llama.cpp's Phi3MiniModel
        original = cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        data = tensor.detach().float().numpy()
        if arch == "llama" and ".attn_q" in gguf_name:
            data = permute_qk(data, heads)
        elif arch == "llama" and ".attn_k" in gguf_name:
            data = permute_qk(data, kv_heads)
        elif arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
        tensors[f"{gguf_name}.{suffix}"] = data
    for tensor_name, data in tensors.items():
        if quant is not None and data.ndim == 2:
            w.add_tensor(tensor_name, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            w.add_tensor(tensor_name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def roundtrip(model: torch.nn.Module, quant: gguf.GGMLQuantizationType) -> torch.nn.Module:
    """`model` with each 2-D weight replaced by its `quant` blocks dequantized: the weights a
    GGUF of that type holds (row permutations commute with the blocks, which lie in rows)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                q = gguf.quants.quantize(param.detach().float().numpy(), quant)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(q, quant)))
    return model


def _add_tokenizer(w: gguf.GGUFWriter) -> None:
    md = smollm2_tokenizer_metadata()
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(md["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(md["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(md["tokenizer.ggml.add_bos_token"])
    w.add_add_space_prefix(md["tokenizer.ggml.add_space_prefix"])
    w.add_chat_template(md["tokenizer.chat_template"])


def write_header_only_gguf(path: Path, arch: str, kv: dict | None = None) -> Path:
    """A GGUF of architecture `arch` with a few shape keys, `kv` (str, float or int values)
    and no tensors: enough for the header checks."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(1024)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_head_count(4)
    for key, value in (kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
