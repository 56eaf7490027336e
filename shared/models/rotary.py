"""Rotary position embeddings (RoPE, Su et al. 2021) in the rotate-half layout of HF Llama.

Supports rope types "default", "linear", "llama3", "yarn", "dynamic" and "longrope", computed
in `rope_scaling.py`. The cos/sin table is computed once in fp32 exactly as transformers
computes it per step (position * inv_freq, then cos/sin, times the attention factor), so
indexing the table gives bit-identical values. Each row is one position; the types whose
frequencies transformers picks by sequence length (dynamic, longrope) are made a function of
the position there, so the torch and fused paths read one table; longrope's table also holds
the long rows of the positions below its original length (`long_rows`), which the model
runner gives the tokens of a request rotated with the long factors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.kernels import cpu_fused
from pdserve.shared.models.rope_scaling import rope_kind, rope_segments


def rope_parameters(cfg: dict) -> dict:
    """transformers 5 keeps theta and scaling in `rope_parameters`; older configs use
    `rope_theta` + `rope_scaling`. Returns one merged dict, standardized as transformers'
    `standardize_rope_params` does it: for llama3, yarn and longrope, a top-level
    `original_max_position_embeddings` wins (Phi-3 keeps it there; Phi3Config's default is
    4096); and Phi-3's old "su" / "yarn" types are longrope (`Phi3Config`)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    if "rope_theta" not in params and cfg.get("rope_theta") is not None:
        params["rope_theta"] = cfg["rope_theta"]
    phi3 = (cfg.get("model_type") == "phi3"
            or (cfg.get("architectures") or [None])[0] == "Phi3ForCausalLM")
    if phi3 and rope_kind(params) in ("su", "yarn"):
        params["rope_type"] = "longrope"
    if rope_kind(params) in ("llama3", "yarn", "longrope"):
        original = cfg.get("original_max_position_embeddings", 4096 if phi3 else None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        elif cfg.get("max_position_embeddings") is not None:
            params.setdefault("original_max_position_embeddings",
                              cfg["max_position_embeddings"])
    return params


def rope_theta_from_config(cfg: dict) -> float:
    return float(rope_parameters(cfg).get("rope_theta", 10000.0))


class LongRows(NamedTuple):
    """Where longrope's table keeps the long-factor rows of the positions below `original`."""

    original: int
    """original_max_position_embeddings: a sequence longer than this is rotated wholly with
    the long factors (rows from `original` on are long already)."""
    offset: int
    """Row of position p < original with the long factors: p + offset (the table's
    `num_rows`)."""


class RotaryInputs(NamedTuple):
    """One step's rotary inputs, built once by `RotaryEmbedding.prepare` for all layers."""

    positions: torch.Tensor
    """[num_tokens] int64, each token's table row (its position, or a long row)."""
    cos: torch.Tensor | None
    """[num_tokens, 1, head_dim] gathered cos rows; None on the fused path (it indexes the
    table itself)."""
    sin: torch.Tensor | None
    """Same for sin."""


class RotaryEmbedding:
    """Holds the [num_rows, head_dim] cos/sin tables (fp32 until `to`), row p for position p;
    longrope's have `long_rows.original` rows more (`rope_scaling.py`'s module docstring)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None, num_rows: int | None = None) -> None:
        """`max_positions` is the config's max_position_embeddings; the tables have
        `num_rows` rows (default: max_positions), plus longrope's long rows."""
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.max_positions = max_positions
        self.num_rows = num_rows or max_positions
        self.long_rows: LongRows | None = None
        """longrope whose sequences can outgrow its original length: where the long rows of
        the positions below it are; None otherwise (no row past `num_rows`)."""
        if rope_kind(scaling) == "longrope":
            original = int(scaling["original_max_position_embeddings"])
            if self.num_rows > original:
                self.long_rows = LongRows(original, self.num_rows)
        self.cos, self.sin = self._tables(torch.device("cpu"))
        self.half = head_dim // 2
        self.use_fused_cpu_ops = False
        """True: rotate in place with `kernels.cpu_fused.rotary_embedding` (fp32 CPU)."""

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        segments, attention_factor = rope_segments(self.head_dim, self.theta, self.scaling,
                                                   self.max_positions, self.num_rows, device)
        freqs = torch.cat([  # [rows, head_dim / 2]
            torch.arange(first, first + stop - start, dtype=torch.float32,
                         device=device)[:, None] * inv_freq
            for start, stop, inv_freq, first in segments])
        emb = torch.cat((freqs, freqs), dim=-1)
        if attention_factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * attention_factor, emb.sin() * attention_factor

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
        """positions [num_tokens] int64 (table rows: each token's position, or a long row,
        `long_rows`) -> this step's RotaryInputs (the torch path gathers the cos/sin rows
        here, once for all layers)."""
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
