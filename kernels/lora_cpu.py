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
mixes a long prefill chunk with decodes of other adapters. The mapping picks per step.
"""

from __future__ import annotations

import torch


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
