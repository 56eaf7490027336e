"""Rotary position embeddings (RoPE, Su et al. 2021) in the rotate-half layout of HF Llama.

Supports rope types "default", "linear" and "llama3" (Llama 3.1's frequency smoothing).
The cos/sin table is computed once in fp32 exactly as transformers computes it per step
(position * inv_freq, then cos/sin), so indexing the table gives bit-identical values.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pdserve.kernels import cpu_fused


def rope_parameters(cfg: dict) -> dict:
    """transformers 5 keeps theta and scaling in `rope_parameters`; older configs use
    `rope_theta` + `rope_scaling`. Returns one merged dict."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    if "rope_theta" not in params and cfg.get("rope_theta") is not None:
        params["rope_theta"] = cfg["rope_theta"]
    return params


def rope_theta_from_config(cfg: dict) -> float:
    return float(rope_parameters(cfg).get("rope_theta", 10000.0))


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3)")


class RotaryInputs(NamedTuple):
    """One step's rotary inputs, built once by `RotaryEmbedding.prepare` for all layers."""

    positions: torch.Tensor
    """[num_tokens] int64, each token's position."""
    cos: torch.Tensor | None
    """[num_tokens, 1, head_dim] gathered cos rows; None on the fused path (it indexes the
    table itself)."""
    sin: torch.Tensor | None
    """Same for sin."""


class RotaryEmbedding:
    """Holds the [max_positions, head_dim] cos/sin tables (fp32 until `to`)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None) -> None:
        self.inv_freq = _inv_freq(head_dim, theta, scaling)
        """[head_dim / 2] fp32 on the CPU, as transformers computes its buffer at load."""
        self.max_positions = max_positions
        self.cos, self.sin = self._tables(torch.device("cpu"))
        self.half = head_dim // 2
        self.use_fused_cpu_ops = False
        """True: rotate in place with `kernels.cpu_fused.rotary_embedding` (fp32 CPU)."""

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, self.inv_freq.to(device))  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def to(self, device: torch.device | str, dtype: torch.dtype) -> RotaryEmbedding:
        """Move the tables to `device` in `dtype`.

        NOTE: cos/sin are recomputed on `device` in fp32, then cast: transformers computes
        them on the model's device each step, and a GPU's cos/sin may differ from the CPU's
        in the last bit (position * inv_freq is one rounding on either).
        """
        device = torch.device(device)
        cos, sin = self._tables(device) if device != self.cos.device else (self.cos, self.sin)
        self.cos = cos.to(dtype=dtype)
        self.sin = sin.to(dtype=dtype)
        return self

    def prepare(self, positions: torch.Tensor) -> RotaryInputs:
        """positions [num_tokens] int64 -> this step's RotaryInputs (the torch path gathers
        the cos/sin rows here, once for all layers)."""
        if self.use_fused_cpu_ops:
            return RotaryInputs(positions.contiguous(), None, None)
        return RotaryInputs(positions, self.cos[positions].unsqueeze(1),
                            self.sin[positions].unsqueeze(1))

    def apply(self, q: torch.Tensor, k: torch.Tensor,
              inputs: RotaryInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, num_heads, D], k [T, num_kv_heads, D] -> rotated q, k.

        The torch path returns rotated copies; the fused path rotates q and k in place
        (views into the qkv projection are fine) and returns them.
        """
        if self.use_fused_cpu_ops:
            cpu_fused.rotary_embedding(q, k, inputs.positions, self.cos, self.sin)
            return q, k
        cos, sin = inputs.cos, inputs.sin
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : self.half], x[..., self.half:]
        return torch.cat((-x2, x1), dim=-1)
