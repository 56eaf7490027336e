"""LinearWithLoRA: a decoder's fused linear layer plus the LoRAs of the adapters resident in
its slots (vLLM's `BaseLayerWithLoRA`), applied per token by the step's `LoRAMapping`.

    y = base(x)                                   as without LoRA: int8, packed, GEMV paths
    y[t] += (x[t] @ A_s^T) @ B_s^T                 for the tokens t of each slot s

Slot weights are stacked per layer: lora_a [max_loras, R_max, in], lora_b [max_loras, out,
R_max], R_max = parts x max_lora_rank (a fused layer's parts stacked, `peft_loader.py`),
zero-padded; the CPU path reads only each slot's true rank (views set at activation).
The layers only exist when LoRA is enabled: without it the model holds plain `Linear`s.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pdserve.kernels.lora_cpu import add_lora_bgmv, add_lora_bmm, add_lora_segments, lora_parts
from pdserve.shared.lora.mapping import LoRAMapping
from pdserve.shared.lora.peft_loader import FusedLinearShape, LoRALayerWeights


class LoRAContext:
    """The step's `LoRAMapping`, shared by every LoRA layer of one model; installed for one
    forward by `step()`, which refuses nesting."""

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None
        self._active = False

    @contextmanager
    def step(self, mapping: LoRAMapping | None) -> Iterator[None]:
        if self._active:
            raise RuntimeError("a LoRA step context is already installed (nested forward)")
        self._active, self.mapping = True, mapping
        try:
            yield
        finally:
            self._active, self.mapping = False, None


class LinearWithLoRA(nn.Module):
    def __init__(self, base_layer: nn.Module, shape: FusedLinearShape, max_loras: int,
                 max_lora_rank: int, context: LoRAContext) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.context = context
        rank = len(shape.part_sizes) * max_lora_rank
        device = _device_of(base_layer)
        # NOTE: fp32 adapters on the CPU, whatever the base (int8 included); on CUDA the
        # activations' dtype.
        dtype = torch.float32 if device.type == "cpu" else next(
            (p.dtype for p in base_layer.parameters()), torch.float32)
        self.lora_a = torch.zeros(max_loras, rank, shape.in_features, device=device,
                                  dtype=dtype)
        """[max_loras, R_max, in]: each slot's stacked A, zero-padded."""
        self.lora_b = torch.zeros(max_loras, sum(shape.part_sizes), rank, device=device,
                                  dtype=dtype)
        """[max_loras, out, R_max]: each slot's B (scale folded in), zero-padded."""
        self.lora_a_t: list[torch.Tensor | None] = [None] * max_loras
        """Per slot A^T [in, r] (a view of lora_a at its true rank); None: no LoRA here."""
        self.lora_b_t: list[torch.Tensor | None] = [None] * max_loras
        self.cpu_kernel = device.type == "cpu" and dtype == torch.float32
        """The C kernel's buffers are kept (CPU, fp32: `kernels/lora_cpu.add_lora_bgmv`)."""
        if self.cpu_kernel:
            out = sum(shape.part_sizes)
            self.lora_bt = torch.zeros(max_loras, rank, out)
            """[max_loras, R_max, out]: each slot's B transposed, contiguous."""
            self.slot_rank = torch.zeros(max_loras, dtype=torch.int64)
            """[max_loras]: the rank rows each slot uses (0: no LoRA here)."""
            self.parts = torch.zeros(max_loras, rank, 4, dtype=torch.int64)
            """[max_loras, R_max, 4]: each slot's non-zero blocks of B (`lora_parts`)."""
            self.num_parts = torch.zeros(max_loras, dtype=torch.int64)

    def set_slot(self, slot: int, weights: LoRALayerWeights | None) -> None:
        """Put an adapter's LoRA of this layer in `slot` (None: the adapter has none here)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if self.cpu_kernel:
            self.lora_bt[slot].zero_()
            self.slot_rank[slot] = self.num_parts[slot] = 0
        if weights is None:
            self.lora_a_t[slot] = self.lora_b_t[slot] = None
            return
        rank = weights.lora_a.shape[0]
        self.lora_a[slot, :rank] = weights.lora_a
        self.lora_b[slot, :, :rank] = weights.lora_b
        self.lora_a_t[slot] = self.lora_a[slot, :rank].t()
        self.lora_b_t[slot] = self.lora_b[slot, :, :rank].t()
        if self.cpu_kernel:
            self.lora_bt[slot, :rank] = weights.lora_b.t()
            parts = lora_parts(weights.lora_b)
            if parts:
                self.parts[slot, :len(parts)] = torch.tensor(parts, dtype=torch.int64)
            self.num_parts[slot] = len(parts)
            self.slot_rank[slot] = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        mapping = self.context.mapping
        if mapping is None:
            return y
        if mapping.token_slots is not None and self.cpu_kernel and add_lora_bgmv(
                y, x, self.lora_a, self.lora_bt, mapping.token_slots, self.slot_rank,
                self.parts, self.num_parts):
            return y
        if mapping.padded is not None:
            add_lora_bmm(y, x, self.lora_a, self.lora_b, *mapping.padded)
        elif mapping.sgmv is not None:
            from pdserve.kernels.triton_lora import add_lora_sgmv

            add_lora_sgmv(y, x.contiguous(), self.lora_a, self.lora_b, *mapping.sgmv)
        else:
            add_lora_segments(y, x, self.lora_a_t, self.lora_b_t, mapping.segments,
                              mapping.token_indices)
        return y


def _device_of(layer: nn.Module) -> torch.device:
    for t in (*layer.parameters(), *(getattr(layer, "int8_weight", None) or ()),
              *(getattr(layer, "gemv", None) or ()), getattr(layer, "packed", None)):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")
