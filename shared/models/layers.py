"""The layers the Llama-family decoder is built from (`shared/models/llama.py`): a linear
layer with its CPU fast paths (the fp32 panel kernels, oneDNN-prepacked, int8), the
embeddings read from a tied LM head's panels or int8 rows, and RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_fused, cpu_gemv, cpu_int8, cpu_linear


class Linear(nn.Linear):
    """nn.Linear that can run from its weight packed in K-major panels (`kernels.cpu_gemv`,
    every number of rows), from a oneDNN-prepacked copy (`kernels.cpu_linear`, where the
    panel kernel cannot be built), both chosen once by `LlamaForCausalLM.set_packed_linear`,
    or from int8 weights (`kernels.cpu_int8`; `LlamaForCausalLM.quantize_int8`). The panels
    and int8 replace the plain `weight` (None then)."""

    packed: torch.Tensor | None = None
    gemv: cpu_gemv.GemvWeight | None = None
    """The weight (and bias) packed for `kernels.cpu_gemv`."""
    int8_weight: cpu_int8.Int8Weight | None = None
    """The weight (and bias) in int8; set, `weight` is None."""

    def full_weight(self) -> torch.Tensor:
        """The fp32 weight [out, in]: `weight`, or unpacked from the GEMV panels."""
        if self.weight is not None:
            return self.weight
        if self.gemv is None:
            raise ValueError("this layer keeps no fp32 weight (int8)")
        return cpu_gemv.unpack_weight(self.gemv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_weight is not None:
            return cpu_int8.linear(x, self.int8_weight)
        if self.gemv is not None:
            out = cpu_gemv.linear(x, self.gemv)
            if out is not None:
                return out
        if self.packed is not None:
            return cpu_linear.linear(x, self.packed, self.bias)
        return F.linear(x, self.full_weight(), self.bias)


class PanelEmbedding(nn.Module):
    """nn.Embedding read from a tied LM head's panels (`kernels.cpu_gemv.GemvWeight`), so the
    vocabulary's rows are held once: `cpu_gemv.rows` gathers row t from panel t // PANEL
    ([num_tokens, hidden_size] in the panels' dtype, the same bits as the plain table)."""

    def __init__(self, head: cpu_gemv.GemvWeight) -> None:
        super().__init__()
        self.head = head

    @property
    def weight(self) -> torch.Tensor:
        """The table [vocab_size, hidden_size] in the panels' dtype, unpacked (a copy)."""
        return cpu_gemv.unpack_weight(self.head)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cpu_gemv.rows(self.head, input_ids.reshape(-1)).view(*input_ids.shape, -1)


class Int8Embedding(nn.Module):
    """nn.Embedding from int8 rows and one fp32 scale per row (`--quantization int8`), in the
    linear kernel's packed layout (a tied LM head shares it)."""

    def __init__(self, weight: cpu_int8.Int8Weight) -> None:
        super().__init__()
        self.int8_weight = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cpu_int8.embedding(input_ids, self.int8_weight)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in fp32 as transformers does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_fused_cpu_ops = False
        """True: `kernels.cpu_fused` (fp32 CPU weights only; see set_fused_cpu_ops)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> norm(x); with a residual -> (norm(x + residual), x + residual).

        NOTE: the fused path works in place: x and residual are overwritten (vLLM's
        fused_add_rms_norm), so pass only tensors this step owns.
        """
        if self.use_fused_cpu_ops:
            if residual is None:
                return cpu_fused.rms_norm(x, self.weight, self.eps)
            cpu_fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def norm_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path over the last dim of any shape (e.g. [T, heads, head_dim])."""
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
