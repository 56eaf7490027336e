"""Inverse frequencies of each rope scaling type, op for op as transformers 5.25 computes them
(`transformers/modeling_rope_utils.py`), so that `rotary.py`'s cos/sin tables equal the values
transformers computes each step, bit for bit.

A table row is one position. default, linear, llama3 and yarn rotate every position with one
inverse-frequency vector, computed at load. dynamic and longrope depend, in transformers, on
the length of the sequence in each forward pass (its `dynamic_rope_update`); here row p holds
what transformers' rotary gives position p as the last position of its forward pass, as in
each of its decode steps, and longrope adds the long rows of the positions below orig:

    rows   0 .............. orig-1 | orig ........... num_rows-1 | num_rows ... num_rows+orig-1
    longrope  short_factor         | long_factor                 | long_factor, positions 0..orig-1
    dynamic   theta (= default)    | NTK base for seq_len p + 1, one per row

What that serves, against transformers' `generate`:
- dynamic (orig = max_position_embeddings): exact, as the engine keeps max_model_len <=
  max_position_embeddings, where dynamic NTK is the default rope. The rows past it are only
  in a table built longer (`num_rows`); a prompt that long would differ from `generate`,
  which rotates all of it with the base of its whole length, while each decode step past it
  equals these rows.
- longrope (orig = original_max_position_embeddings): transformers rotates a forward pass
  whose last position is below orig with the short factors, a longer one wholly with the
  long factors, and Phi-3's `prepare_inputs_for_generation` recomputes the cache of a
  sequence that grows past orig with them. The engine serves that per request: a request
  longer than orig is "long" (`Request.rope_long`: the scheduler recomputes it from position
  0 when it crosses orig) and the model runner gives its tokens below orig the rows
  `position + num_rows` (`RotaryEmbedding.long_rows`); every other token reads row
  `position`. Exact at every length.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class RopeSegment(NamedTuple):
    """Table rows [start, stop), the positions first_position, first_position + 1, ..., and
    their inverse frequencies: [head_dim / 2] for all of them, or [stop - start,
    head_dim / 2], one per row."""

    start: int
    stop: int
    inv_freq: torch.Tensor
    first_position: int


def rope_kind(scaling: dict | None) -> str:
    scaling = scaling or {}
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


CPU = torch.device("cpu")
"""Named in every constructor: the loader builds the model under a meta device context."""


def _exponents(dim: int, device: torch.device = CPU) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def rope_segments(head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                  num_rows: int, device: torch.device) -> tuple[list[RopeSegment], float]:
    """The rows of a [num_rows, head_dim] table (longrope: [num_rows + orig, head_dim] when
    num_rows > orig, module docstring) and the attention factor that multiplies cos and sin
    (transformers' `attention_scaling`).

    Args:
        max_positions: the config's `max_position_embeddings`.
        device: where transformers computes what it computes in the forward pass (longrope's
            long factors, dynamic's grown bases); what it computes at load is computed on the
            CPU, as there.

    Raises:
        ValueError: a rope type not implemented here.
    """
    kind = rope_kind(scaling)
    if kind in ("default", "linear", "llama3", "yarn"):
        inv_freq, attention_factor = _static_inv_freq(kind, head_dim, theta, scaling,
                                                      max_positions)
        return [RopeSegment(0, num_rows, inv_freq.to(device), 0)], attention_factor
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, max_positions, num_rows, device)
    if kind == "dynamic":
        return _dynamic(head_dim, theta, scaling["factor"], max_positions, num_rows,
                        device), 1.0
    raise ValueError(f"rope_type {kind!r} is not supported "
                     "(default, linear, llama3, yarn, dynamic, longrope)")


def _static_inv_freq(kind: str, dim: int, theta: float, scaling: dict | None,
                     max_positions: int) -> tuple[torch.Tensor, float]:
    """default, linear, llama3 (`_compute_llama3_parameters`) and yarn
    (`_compute_yarn_parameters`): one vector for all positions, computed at load."""
    inv_freq = 1.0 / (theta ** _exponents(dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_positions)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023) as `_compute_yarn_parameters`: a ramp between interpolated and
    extrapolated frequencies, and an attention factor on cos and sin. Static."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = max_positions / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale)
                                     / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=CPU) - low) / (high - low)
    ramp = torch.clamp(ramp, 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=CPU).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(dtype=torch.float)
    inv_freq = (interpolation * (1 - extrapolation_factor)
                + extrapolation * extrapolation_factor)
    return inv_freq, float(attention_factor)


def _longrope(dim: int, base: float, scaling: dict, max_positions: int, num_rows: int,
              device: torch.device) -> tuple[list[RopeSegment], float]:
    """LongRoPE (Phi-3, `_compute_longrope_parameters`): short factors below
    original_max_position_embeddings, long ones from it, then the long rows of the positions
    below it (module docstring); one attention factor for both. transformers computes the
    short vector at load (CPU), the long one in the forward pass (on the model's device)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0 else
                            math.sqrt(1 + math.log(factor) / math.log(original)))

    def inv_freq(ext_factor: list[float], on: torch.device) -> torch.Tensor:
        ext = torch.tensor(ext_factor, dtype=torch.float32, device=on)
        return 1.0 / (ext * base ** _exponents(dim, on))

    boundary = min(original, num_rows)
    short = inv_freq(scaling["short_factor"], CPU).to(device)
    segments = [RopeSegment(0, boundary, short, 0)]
    if num_rows > original:
        long = inv_freq(scaling["long_factor"], device)
        segments += [RopeSegment(original, num_rows, long, original),
                     RopeSegment(num_rows, num_rows + original, long, 0)]
    return segments, float(attention_factor)


def _dynamic(dim: int, base: float, factor: float | int, max_positions: int, num_rows: int,
             device: torch.device) -> list[RopeSegment]:
    """Dynamic NTK (`_compute_dynamic_ntk_parameters`): theta's frequencies up to
    max_position_embeddings (the base computed at load, for seq_len = max_position_embeddings,
    is theta itself); from there, row p holds the base transformers computes in the forward
    pass for seq_len p + 1 (module docstring), with its tensor ops, one row at a time (pow on a
    batch of rows may round differently from pow on one)."""
    seq_len = max_positions
    load_base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    segments = [RopeSegment(0, min(max_positions, num_rows),
                            (1.0 / (load_base ** _exponents(dim))).to(device), 0)]
    if num_rows > max_positions:
        grown = []
        for position in range(max_positions, num_rows):
            seq = torch.tensor(position + 1, device=device)
            seq = torch.maximum(seq, torch.tensor(max_positions, dtype=seq.dtype, device=device))
            grown_base = base * ((factor * seq / max_positions) - (factor - 1)) ** (dim / (dim - 2))
            grown.append(1.0 / (grown_base ** _exponents(dim, device)))
        segments.append(RopeSegment(max_positions, num_rows, torch.stack(grown),
                                    max_positions))
    return segments
