"""Batched multi-LoRA on the CPU: y[t] += (x[t] @ A_s^T) @ B_s^T for the tokens t of each
adapter slot s, with every adapter of a step served in one pass (Punica, Chen et al. 2023;
S-LoRA, Sheng et al. 2023), not one call per request.

The step's tokens are grouped by slot once per step (`shared/lora/mapping.py`):

    token_indices  [L] int64   the batch rows of the L LoRA tokens, sorted by slot
    segments       [(slot, start, end), ...]  rows token_indices[start:end] use `slot`

    x ──index_select(token_indices)──▶ xs [L, in]
        per segment:  xs[start:end] @ A_s^T ──▶ [n, R_s] ──@ B_s^T──▶ delta[start:end]
    y.index_add_(0, token_indices, delta)

When the LoRA tokens already lie in slot order (`token_indices` None: one adapter, or
requests grouped by adapter), the segments are batch rows and the gather/scatter go away:
y[start:end] += (x[start:end] @ A_s^T) @ B_s^T in place (addmm_).

`add_lora_bmm` is the padded formulation: every slot's tokens padded to the longest segment,
two `torch.bmm`s over all slots: fewer, larger ops, which win when the segments are about
equally long (decodes spread over the adapters: at 32 tokens over 4 adapters it beat the loop
in two of three sessions, see `shared/lora/mapping.py`); the loop wastes nothing on a step that
mixes a long prefill chunk with decodes of other adapters.

`add_lora_bgmv` is the C kernel (`csrc/lora_cpu.c`, Punica's BGMV): one call per layer for
the few tokens of a decode step, each token reading its own slot's A and B, no gather, no
scatter: at 32 decode tokens over 4 adapters the torch forms spend most of their time in op
dispatch and OpenMP fork/join (benchmarks/lora.py: "cpu_kernels_ms_per_layer"). The mapping
picks per step (`shared/lora/mapping.py`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from pdserve.kernels.cpu_build import load_library

SOURCE = Path(__file__).parent / "csrc" / "lora_cpu.c"
FLAG_SETS = ((("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)),
             (("-O3", "-fopenmp"), ("-fopenmp",)))
"""Tried in order (never -ffast-math: see cpu_build.py)."""


def kernel_enabled() -> bool:
    """PDSERVE_CPU_LORA is not "0" (the switch for A/B runs and debugging)."""
    return os.environ.get("PDSERVE_CPU_LORA", "1") != "0"


@functools.cache
def load_kernel():
    """Compiles and loads `csrc/lora_cpu.c`; None without a C compiler (the torch forms
    then run every step)."""
    lib = load_library(SOURCE, (), FLAG_SETS)
    if lib is None:
        return None
    fn = lib.lora_bgmv_add
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64,
                   ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def lora_parts(lora_b: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """The blocks of a slot's B [out, R] that may be non-zero, as (out_start, out_end,
    rank_start, rank_end): runs of rank columns whose non-zero rows span the same range (a
    fused layer's stacked parts, `shared/lora/peft_loader.py`). All-zero columns are left
    out: skipping them changes no result."""
    nonzero = lora_b != 0
    any_rows = nonzero.any(dim=0).tolist()
    first = nonzero.float().argmax(dim=0).tolist()
    last = (lora_b.shape[0] - 1 - nonzero.flip(0).float().argmax(dim=0)).tolist()
    parts: list[list[int]] = []
    for j, used in enumerate(any_rows):
        if not used:
            continue
        if parts and parts[-1][3] == j and parts[-1][0] == first[j] \
                and parts[-1][1] == last[j] + 1:
            parts[-1][3] = j + 1
        else:
            parts.append([first[j], last[j] + 1, j, j + 1])
    return [tuple(p) for p in parts]


def add_lora_bgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                  lora_bt: torch.Tensor, token_slots: torch.Tensor, slot_rank: torch.Tensor,
                  parts: torch.Tensor, num_parts: torch.Tensor) -> bool:
    """In place, the C kernel: y[t] += B_s (A_s x[t]) for s = token_slots[t] >= 0.

    Args:
        y: [num_tokens, out] float32, rows contiguous (stride(1) == 1).
        x: [num_tokens, in] float32, rows contiguous.
        lora_a: [num_slots, R, in] float32 contiguous (zero-padded ranks).
        lora_bt: [num_slots, R, out] float32 contiguous: B transposed, scale folded in.
        token_slots: [num_tokens] int64, -1 for a base-model token.
        slot_rank: [num_slots] int64, the rank rows each slot uses (0: no LoRA here).
        parts: [num_slots, max_parts, 4] int64 (`lora_parts` of each slot's B).
        num_parts: [num_slots] int64.

    Returns False (y untouched) when the kernel is not built or the input is not float32
    with contiguous rows; the caller then runs a torch form.
    """
    kernel = load_kernel()
    if (kernel is None or x.dtype != torch.float32 or y.dtype != torch.float32
            or x.stride(1) != 1 or y.stride(1) != 1):
        return False
    num_tokens, in_features = x.shape
    num_slots, max_rank, _ = lora_a.shape
    scratch = torch.empty(num_tokens, max_rank)
    kernel(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), num_tokens, in_features,
           y.shape[1], lora_a.data_ptr(), lora_bt.data_ptr(), max_rank,
           token_slots.data_ptr(), slot_rank.data_ptr(), parts.data_ptr(),
           num_parts.data_ptr(), parts.shape[1], scratch.data_ptr(), torch.get_num_threads())
    return True


def add_lora_segments(y: torch.Tensor, x: torch.Tensor, lora_a_t: list[torch.Tensor | None],
                      lora_b_t: list[torch.Tensor | None],
                      segments: list[tuple[int, int, int]],
                      token_indices: torch.Tensor | None) -> None:
    """In place: y[t] += (x[t] @ lora_a_t[s]) @ lora_b_t[s] for each segment's tokens.

    Args:
        y: [num_tokens, out] the base layer's output.
        x: [num_tokens, in] its input.
        lora_a_t: per slot A^T [in, R_s] (None: the slot's adapter has no LoRA here).
        lora_b_t: per slot B^T [R_s, out] (scale folded in).
        segments: (slot, start, end) over the sorted LoRA tokens.
        token_indices: [L] int64 batch rows of the sorted LoRA tokens; None: the sorted
            order is the batch order (segments index rows of x and y directly).
    """
    if token_indices is None:
        for slot, start, end in segments:
            a_t = lora_a_t[slot]
            if a_t is not None:
                y[start:end].addmm_(torch.mm(x[start:end], a_t), lora_b_t[slot])
        return
    xs = x.index_select(0, token_indices)
    delta = y.new_zeros((xs.shape[0], y.shape[1]))
    for slot, start, end in segments:
        a_t = lora_a_t[slot]
        if a_t is not None:
            torch.mm(torch.mm(xs[start:end], a_t), lora_b_t[slot], out=delta[start:end])
    y.index_add_(0, token_indices, delta)


def add_lora_bmm(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 padded_indices: torch.Tensor, source_rows: torch.Tensor) -> None:
    """In place, the padded formulation: every slot's tokens padded to the longest segment.

    Args:
        y: [num_tokens, out]; x: [num_tokens, in].
        lora_a: [num_slots, R, in] stacked A (zero-padded ranks; zeros for empty slots).
        lora_b: [num_slots, out, R] stacked B (scale folded in).
        padded_indices: [num_slots, max_len] int64 batch rows, padding rows point at row 0.
        source_rows: [num_tokens] int64: each batch row's row of the padded delta
            (slot * max_len + position), num_slots * max_len (a zero row) for a base token.

    NOTE: the delta goes back by a gather (index_select) and one add rather than by
    `index_add_`, whose scatter was 1.5-4x slower here with two threads.
    """
    num_slots, max_len = padded_indices.shape
    xs = x.index_select(0, padded_indices.view(-1)).view(num_slots, max_len, -1)
    delta = y.new_empty((num_slots * max_len + 1, y.shape[1]))
    delta[-1].zero_()
    torch.bmm(torch.bmm(xs, lora_a.transpose(1, 2)), lora_b.transpose(1, 2),
              out=delta[:-1].view(num_slots, max_len, -1))
    y.add_(delta.index_select(0, source_rows))


def lora_reference(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   token_slots: torch.Tensor) -> torch.Tensor:
    """The obviously-correct delta, token by token: [num_tokens, out], zero where
    token_slots[t] < 0 (a base-model token). lora_a [S, R, in], lora_b [S, out, R]."""
    delta = x.new_zeros((x.shape[0], lora_b.shape[1]))
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            delta[t] = lora_b[slot] @ (lora_a[slot] @ x[t])
    return delta
