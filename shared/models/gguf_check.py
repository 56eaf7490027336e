"""What a GGUF file holds, read from its header alone (no torch, no transformers, no conversion).

pdserve serves a GGUF by converting it once into an HF directory (`convert.py`, through
transformers' GGUF loader). Before that, this module reads the header (milliseconds: string
arrays such as the vocabulary are skipped, never decoded) in order to

- refuse an architecture or rope scaling pdserve does not serve from GGUF, in one line naming
  it, before any conversion or service starts (`pdserve up` runs it in its torch-free launcher);
- recover what transformers' loader drops although the tokens depend on it (`gguf_hf_config`):
  llama.cpp writes linear rope scaling as metadata and Llama 3's rope scaling as a
  `rope_freqs` tensor of per-frequency divisors (transformers reads neither, and would serve
  the default rope), an explicit head_dim as `attention.key_length` (transformers reads it
  only for Gemma), Phi-3's sliding window, and what llama.cpp fixes for Gemma 2 / 3 without
  writing it (`_gemma_config`).

    GGUF general.architecture   transformers builds        llama.cpp writes as it
    llama                       LlamaForCausalLM           Llama 2/3.x, SmolLM2, Mistral
    qwen2 / qwen3 / phi3        Qwen2 / Qwen3 / Phi3ForCausalLM
    gemma2 / gemma3             Gemma2ForCausalLM / Gemma3ForCausalLM (text-only)
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
"""GGUF architecture -> the HF architecture transformers converts it to; each one proven token
for token by tests/shared/models/test_gguf_families.py. Others (falcon, gpt2, mamba, ...) are
refused until a test proves their conversion. Gemma 2 / 3 take llama.cpp's fixed choices, which
transformers' loader leaves at its own defaults (`_gemma_config`). A Mistral GGUF is a llama
one (as llama.cpp writes it) and becomes a LlamaForCausalLM, the same computation without a
sliding window."""

GGUF_ROPE_SCALINGS = ("none", "linear", "llama3", "longrope")
"""Rope scalings recovered exactly from a GGUF (llama3: from its `rope_freqs` tensor;
longrope, Phi-3.5's: from its `rope_factors_long` / `_short` tensors)."""

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOAT_TYPES = {0: "f", 1: "e"}  # ggml F32, F16


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF's metadata and tensor table. Arrays of strings are kept as their length."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], int, int]]
    """name -> (shape in torch order, ggml type, offset from `data_start`)"""
    data_start: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` of the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse the header of a GGUF (v2 or v3) without reading any tensor data.

    Raises:
        ValueError: not a GGUF file, or a truncated or unreadable header.
    """
    path = str(path)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 24:
                raise ValueError(f"{path}: not a GGUF file (shorter than a GGUF header)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
                return _parse(path, blob)
    except (struct.error, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None


def _parse(path: str, blob: mmap.mmap) -> GGUFHeader:
    if blob[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic bytes)")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    pos, metadata = 24, {}
    for _ in range(num_kv):
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, kind)
    tensors = {}
    for _ in range(num_tensors):
        name, pos = _string(blob, pos)
        (ndim,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{ndim}Q", blob, pos + 4)
        kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        tensors[name] = (tuple(reversed(dims)), kind, offset)  # ggml lists dims fastest first
    alignment = int(metadata.get("general.alignment", 32))
    return GGUFHeader(path, metadata, tensors, -(-pos // alignment) * alignment)


def _string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return blob[pos + 8:pos + 8 + length].decode("utf-8"), pos + 8 + length


def _value(blob: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALAR:
        return struct.unpack_from(_SCALAR[kind], blob, pos)[0], pos + struct.calcsize(
            _SCALAR[kind])
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ValueError(f"metadata value type {kind} is unknown")
    item, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item in _SCALAR:
        fmt = _SCALAR[item][1]
        return list(struct.unpack_from(f"<{count}{fmt}", blob, pos)), pos + count * \
            struct.calcsize(fmt)
    if item != _STRING:
        raise ValueError(f"metadata array of type {item} is not supported")
    for _ in range(count):  # a vocabulary or merge list: walked, not decoded
        (length,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + length
    return count, pos


def read_float_tensor(header: GGUFHeader, name: str) -> list[float]:
    """The values of a small F32 / F16 tensor (rope factors), read from the file."""
    shape, kind, offset = header.tensors[name]
    if kind not in _FLOAT_TYPES:
        raise ValueError(f"{header.path}: tensor {name} has ggml type {kind}, not F32 or F16")
    count = math.prod(shape)
    fmt = f"<{count}{_FLOAT_TYPES[kind]}"
    with open(header.path, "rb") as f:
        f.seek(header.data_start + offset)
        return list(struct.unpack(fmt, f.read(struct.calcsize(fmt))))


ONLY_CHECKED = ("architectures", "model_type", "max_position_embeddings", "num_hidden_layers")
"""Entries of `gguf_hf_config` that transformers' loader already sets right."""


def gguf_hf_config(header: GGUFHeader) -> dict[str, Any]:
    """The HF config entries of this GGUF that pdserve checks (`check_hf_config`) and that
    transformers' GGUF loader leaves out or gets wrong; `convert.py` applies those not in
    `ONLY_CHECKED` to the config it loads with.

    Raises:
        ValueError: in one line naming it, an architecture not in GGUF_ARCHITECTURES or a rope
            scaling not in GGUF_ROPE_SCALINGS.
    """
    arch = header.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported GGUF "
                         f"architectures: {', '.join(GGUF_ARCHITECTURES)})")
    hf_arch = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and header.metadata.get("general.name") == "mistral":
        # transformers' loader makes such a file a "mistral" model, and then finds no
        # "mistral" architecture in gguf-py to map its tensors with (gguf 0.19)
        raise ValueError("a GGUF of architecture 'llama' named exactly 'mistral' cannot be "
                         "converted by transformers' GGUF loader: rename it (general.name)")
    hidden = int(header.get("embedding_length", 0))
    heads = max(int(header.get("attention.head_count", 1)), 1)
    head_dim = int(header.get("attention.key_length") or hidden // heads)
    cfg: dict[str, Any] = {"architectures": [hf_arch], "model_type": arch,
                           "max_position_embeddings": int(header.get("context_length", 2048)),
                           "num_hidden_layers": int(header.get("block_count", 0))}
    if header.get("attention.key_length") is not None or arch == "qwen3":
        cfg["head_dim"] = head_dim  # Qwen3Config's default (128) is not hidden // heads
    rotary = header.get("rope.dimension_count")
    if arch == "phi3" and rotary is not None and int(rotary) != head_dim:
        cfg["partial_rotary_factor"] = int(rotary) / head_dim
    theta = float(header.get("rope.freq_base", 10000.0))
    cfg["rope_parameters"] = (_rope_parameters(header, head_dim)
                              or {"rope_type": "default", "rope_theta": theta})
    if cfg["rope_parameters"]["rope_type"] == "longrope":  # Phi3Config's own (4096) wins
        cfg["original_max_position_embeddings"] = cfg["rope_parameters"][
            "original_max_position_embeddings"]
    window = header.get("attention.sliding_window")
    if window:  # llama.cpp writes 0 for "none" (Phi-4)
        cfg["sliding_window"] = int(window)
    if arch in ("gemma2", "gemma3"):
        cfg.update(_gemma_config(header, head_dim, cfg["rope_parameters"]))
    return cfg


def _gemma_config(header: GGUFHeader, head_dim: int, rope: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp fixes for Gemma 2 / 3 instead of reading it from the file
    (llama-model.cpp), which transformers' loader leaves at its config class's defaults:

    - queries scaled by 1 / sqrt(head_dim); by 1 / sqrt(hidden / heads) for the 27B models
      (46 / 62 layers) -- transformers' default query_pre_attn_scalar is 256;
    - layer il local (sliding) when il % 2 < 1 (Gemma 2) or il % 6 < 5 (Gemma 3);
    - Gemma 2's soft-caps from the file (50 and 30 when absent); Gemma 3 has none;
    - Gemma 3's local layers rotate with base 10000, unscaled; the file's rope (its base and
      linear scaling) is the global layers' (transformers would drop the scaling).
    """
    arch, layers = header.architecture, int(header.get("block_count", 0))
    heads = max(int(header.get("attention.head_count", 1)), 1)
    big = layers == (46 if arch == "gemma2" else 62)
    period = 2 if arch == "gemma2" else 6
    cfg: dict[str, Any] = {
        "query_pre_attn_scalar": int(header.get("embedding_length", 0)) // heads if big
        else head_dim,
        "layer_types": ["sliding_attention" if i % period < period - 1 else "full_attention"
                        for i in range(layers)]}
    if arch == "gemma2":
        cfg["attn_logit_softcapping"] = float(header.get("attn_logit_softcapping", 50.0))
        cfg["final_logit_softcapping"] = float(header.get("final_logit_softcapping", 30.0))
    else:
        cfg["attn_logit_softcapping"] = cfg["final_logit_softcapping"] = None
        cfg["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": rope}
    return cfg


def _rope_parameters(header: GGUFHeader, head_dim: int) -> dict[str, Any] | None:
    """transformers 5's `rope_parameters` for a scaled rope; None: the default rope."""
    theta = float(header.get("rope.freq_base", 10000.0))
    kind = str(header.get("rope.scaling.type") or "none")
    factor = header.get("rope.scaling.factor") or header.get("rope.scale_linear")
    if kind == "none" and factor not in (None, 1.0):
        kind = "linear"  # older files: rope.scale_linear only
    if "rope_factors_long.weight" in header.tensors:
        return _longrope(header, theta)
    if "rope_freqs.weight" in header.tensors:
        if kind != "none":
            raise ValueError(f"GGUF rope scaling {kind!r} with a rope_freqs tensor is not "
                             "supported")
        return _llama3_from_factors(read_float_tensor(header, "rope_freqs.weight"), theta,
                                    head_dim)
    if kind not in GGUF_ROPE_SCALINGS:
        raise ValueError(f"GGUF rope scaling {kind!r} of {header.architecture} is not supported "
                         f"(supported GGUF rope scalings: {', '.join(GGUF_ROPE_SCALINGS)})")
    if kind == "none" or factor in (None, 1.0):
        return None
    return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}


def _longrope(header: GGUFHeader, theta: float) -> dict[str, Any]:
    """Phi-3.5's longrope: llama.cpp writes both factor lists as tensors, the original length
    and the attention factor it computed (longrope's; Phi-3's "yarn" also has both lists, and
    yarn's factor: refused)."""
    original = int(header.get("rope.scaling.original_context_length") or 4096)
    scale = int(header.get("context_length", original)) / original
    expected = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    attn = header.get("rope.scaling.attn_factor")
    if attn is not None and abs(float(attn) - expected) > 1e-4 * expected:
        raise ValueError(f"GGUF rope factors of {header.architecture} with attention factor "
                         f"{attn:.4f} (longrope's is {expected:.4f}: Phi-3's yarn?) are not "
                         "supported")
    return {"rope_type": "longrope", "rope_theta": theta,
            "long_factor": read_float_tensor(header, "rope_factors_long.weight"),
            "short_factor": read_float_tensor(header, "rope_factors_short.weight"),
            "original_max_position_embeddings": original}


def _llama3_from_factors(factors: list[float], theta: float,
                         head_dim: int) -> dict[str, Any] | None:
    """Llama 3's rope parameters from llama.cpp's `rope_freqs` (inv_freq[i] is divided by
    factors[i]).

    llama3 divides by 1 above a high frequency boundary, by `factor` below a low one, and in
    between by 1 / ((1 - s) / factor + s) with s linear in the frequency. The boundaries are
    recovered from the factors (fitted where two or more lie in between; placed in the gaps
    otherwise: every such choice gives the same divisors), then checked by recomputing them.
    """
    if len(factors) != head_dim // 2:
        raise ValueError(f"GGUF rope_freqs has {len(factors)} values for head_dim {head_dim}")
    big = max(factors)
    if abs(big - 1.0) < 1e-6:
        return None
    # u: frequency in turns per position (1 / wavelength), falling with i
    u = [theta ** (-2 * i / head_dim) / (2 * math.pi) for i in range(len(factors))]
    tol = 1e-5 * big
    ones = [x for x, f in zip(u, factors) if abs(f - 1.0) <= tol]
    bigs = [x for x, f in zip(u, factors) if abs(f - big) <= tol]
    mids = [(x, (1 / f - 1 / big) / (1 - 1 / big)) for x, f in zip(u, factors)
            if abs(f - 1.0) > tol and abs(f - big) > tol]  # (u, s)
    above, below = min(ones, default=math.inf), max(bigs, default=0.0)
    if len(mids) >= 2:
        (x0, s0), (x1, s1) = mids[0], mids[-1]
        slope = (s0 - s1) / (x0 - x1)
        u_low = x1 - s1 / slope
        u_high = u_low + 1 / slope
    elif len(mids) == 1:
        (x, s), = mids
        width = min((above - x) / (1 - s) if above < math.inf else math.inf,
                    (x - below) / s if s > 0 else math.inf)
        width = width if width < math.inf else x
        u_low, u_high = x - s * width, x + (1 - s) * width
    else:
        u_low = below
        u_high = above if above < math.inf else 2 * below
    # Only original / low and original / high matter: take low_freq_factor 1 (as every Llama
    # 3.x has it), which recovers the checkpoint's own three values wherever two or more
    # factors lie in between.
    original = max(round(1 / u_low), 1)
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": float(big),
              "low_freq_factor": u_low * original, "high_freq_factor": u_high * original,
              "original_max_position_embeddings": original}
    snapped = {**params, "low_freq_factor": round(params["low_freq_factor"], 4),
               "high_freq_factor": round(params["high_freq_factor"], 4)}
    if _llama3_matches(snapped, u, factors):  # float32 factors: 4.0 comes back as 4.00000007
        params = snapped
    if not _llama3_matches(params, u, factors):
        raise ValueError("GGUF rope_freqs are not Llama 3 rope scaling, which is the only "
                         "per-frequency rope scaling supported from GGUF")
    return params


def _llama3_matches(params: dict[str, Any], u: list[float], factors: list[float]) -> bool:
    """Whether transformers' llama3 formula with `params` divides each frequency by factors[i]."""
    old, big = params["original_max_position_embeddings"], params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    for x, want in zip(u, factors):
        wavelen = 1 / x
        if wavelen < old / high:
            got = 1.0
        elif wavelen > old / low:
            got = big
        else:
            s = (old / wavelen - low) / (high - low)
            got = 1 / ((1 - s) / big + s)
        if abs(got - want) > 1e-5 * max(1.0, want):
            return False
    return True


def check_gguf(path: str | Path, max_model_len: int | None = 0) -> dict[str, Any]:
    """Refuse, in one line naming it, a GGUF pdserve would not serve exactly; returns its
    `gguf_hf_config` otherwise. `max_model_len`: as `check_hf_config` takes it (0: the
    engine's default; None: whatever the engine's length will be).

    Raises:
        ValueError: the architecture, rope scaling or (through `check_hf_config`) any other
            part pdserve does not implement, prefixed with the file's name.
    """
    from pdserve.shared.models.architectures import check_hf_config

    header = read_gguf_header(path)
    try:
        cfg = gguf_hf_config(header)
        if max_model_len == 0:
            max_model_len = min(cfg["max_position_embeddings"], 8192)
        check_hf_config(cfg, max_model_len)
    except ValueError as e:
        raise ValueError(f"{Path(path).name}: {e}") from None
    return cfg
