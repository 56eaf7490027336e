"""LoRAMapping: which adapter slot each token of a step uses, grouped once per step (like the
attention metadata) for every LoRA layer of the forward (`kernels/lora_cpu.py`,
`kernels/triton_lora.py`).

Worked example: requests [a (slot 1, 1 token), b (base, 1), c (slot 0, 1), d (slot 1, 3)]:

    batch row     0  1  2  3  4  5
    token slot    1 -1  0  1  1  1
    sorted rows   2 | 0  3  4  5            token_indices = [2, 0, 3, 4, 5]
    segments      (0, 0, 1), (1, 1, 5)      (slot, start, end) into token_indices

When the LoRA tokens already form one run per slot in batch order (one adapter in the step,
or requests of one adapter next to each other), the runs themselves are the segments over
batch rows and `token_indices` is None: the CPU path then neither gathers nor scatters.

On the CPU, a step whose slots' segments are about equally long (decodes spread over the
adapters) also gets `padded`: every slot's rows padded to the longest segment, for two
`torch.bmm`s over all slots (`kernels.lora_cpu.add_lora_bmm`): 5 ops per layer instead of 2
per segment plus a gather and a scatter. At 32 decode tokens over 4 adapters, one decoder
layer's four LoRA layers took (benchmarks/lora.py, "cpu_kernels_ms_per_layer", this project's
shared 2-core machine under load from other jobs) 5.8-6.5 / 2.8 / 1.2 ms with the bmm against
12.8-20.8 / 2.5 / 6.0 ms with the segment loop in three sessions: the bmm won two of three.
With little padding allowed (`MAX_PADDING`) a long prefill chunk beside decodes keeps the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.lora_cpu import kernel_enabled, load_kernel


@dataclass(slots=True)
class LoRAMapping:
    segments: list[tuple[int, int, int]]
    """(slot, start, end): rows [start, end) of the sorted LoRA tokens use `slot` (of the
    batch directly when `token_indices` is None)."""
    token_indices: torch.Tensor | None
    """[L] int64 batch rows of the LoRA tokens sorted by slot; None: segments are batch rows."""
    padded: tuple[torch.Tensor, torch.Tensor] | None = None
    """CPU, balanced steps: ([num_slots, max_len] int64 batch rows of each slot's tokens,
    padding -> row 0; [num_tokens] int64 each row's row of the padded delta, the zero row
    num_slots * max_len for base tokens) for `add_lora_bmm`."""
    token_slots: torch.Tensor | None = None
    """CPU, a step of at most `BGMV_MAX_TOKENS` tokens with the C kernel built: [num_tokens]
    int64 each batch row's slot (-1: base) for `kernels.lora_cpu.add_lora_bgmv`, which the
    layers run first (the other fields are its fallback)."""
    sgmv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
    """CUDA only: (token_indices, seg_start, seg_len, seg_slot, max_seg_len) on the device,
    the Triton kernels' arguments (always sorted form)."""


BGMV_MAX_TOKENS = 64
"""The most tokens of a step the C kernel takes: past a few dozen tokens (a prefill chunk)
BLAS's matmuls, which reuse each weight across tokens, win."""

MAX_PADDING = 1.5
"""`padded` only when all slots' padded rows are at most this many times the LoRA tokens."""

PADDED_MAX_TOKENS = 256
"""`padded` only for steps of at most this many tokens: at a 2,048-token prefill over 4
adapters its two gathers of whole activations cost more than the matmuls (SmolLM2, one
decoder layer's four LoRA layers: 33 ms padded against 19 ms as segments, the base 83 ms)."""

MIN_RUN_TOKENS = 16
"""Runs of one slot at least this long on average (prefill chunks) go as they are, whatever
their number: at 128 tokens in runs of 16 the runs took 1.2 ms per decoder layer against 1.4
sorted, in runs of 32 0.8 against 1.3 (runs of 8: 1.9 against 1.3)."""


def build_lora_mapping(request_slots: list[int], q_lens: np.ndarray, device: torch.device,
                       num_slots: int = 0) -> LoRAMapping | None:
    """The step's mapping from each scheduled request's slot (-1: base model) and its number
    of tokens; None when no token of the step uses an adapter (the LoRA layers then cost one
    attribute read each). `num_slots` (max_loras; 0: no padded form) sizes `padded`."""
    if max(request_slots, default=-1) < 0:
        return None
    token_slots = np.repeat(np.asarray(request_slots, np.int64), q_lens)
    bgmv = None
    if device.type == "cpu" and len(token_slots) <= BGMV_MAX_TOKENS and kernel_enabled() \
            and load_kernel() is not None:
        bgmv = torch.from_numpy(token_slots)
    lora_rows = np.flatnonzero(token_slots >= 0)
    slots_of_rows = token_slots[lora_rows]
    # runs of one slot in batch order (a base token between two rows ends a run)
    breaks = np.flatnonzero((np.diff(slots_of_rows) != 0) | (np.diff(lora_rows) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(lora_rows)]))
    num_used_slots = len(np.unique(slots_of_rows))
    if device.type != "cuda" and (len(starts) <= num_used_slots + 1
                                  or len(lora_rows) >= MIN_RUN_TOKENS * len(starts)):
        # NOTE: a run costs two small matmuls; a gather + scatter about as much as one more
        # run: few runs go as they are, and so do long ones (prefill chunks).
        return LoRAMapping([(int(slots_of_rows[s]), int(lora_rows[s]),
                             int(lora_rows[s]) + int(e - s)) for s, e in zip(starts, ends)], None,
                           token_slots=bgmv)
    order = np.argsort(slots_of_rows, kind="stable")
    sorted_slots = slots_of_rows[order]
    token_indices = lora_rows[order]
    bounds = np.flatnonzero(np.diff(sorted_slots)) + 1
    seg_start = np.concatenate(([0], bounds))
    seg_end = np.concatenate((bounds, [len(order)]))
    segments = [(int(sorted_slots[s]), int(s), int(e)) for s, e in zip(seg_start, seg_end)]
    indices = torch.from_numpy(token_indices).to(device)
    max_len = int((seg_end - seg_start).max())
    if bgmv is not None:
        return LoRAMapping(segments, indices, token_slots=bgmv)
    if device.type != "cuda" and len(token_slots) <= PADDED_MAX_TOKENS \
            and 0 < num_slots * max_len <= MAX_PADDING * len(order):
        padded = np.zeros((num_slots, max_len), np.int64)
        source_rows = np.full(len(token_slots), num_slots * max_len, np.int64)
        for slot, start, end in segments:
            padded[slot, :end - start] = token_indices[start:end]
            source_rows[token_indices[start:end]] = slot * max_len + np.arange(end - start)
        return LoRAMapping(segments, indices, padded=(torch.from_numpy(padded),
                                                      torch.from_numpy(source_rows)))
    sgmv = None
    if device.type == "cuda":
        as_i32 = [torch.from_numpy(a.astype(np.int32)).to(device)
                  for a in (seg_start, seg_end - seg_start, sorted_slots[seg_start])]
        sgmv = (indices, *as_i32, max_len)
    return LoRAMapping(segments, indices, sgmv)
