"""int8 linear layers and embeddings on CPU (`--quantization int8`): weights quantized once at
load time, symmetric per output channel; activations stay fp32 (weight-only int8).

    w8 = quantize_linear(weight, bias)             # Int8Weight: int8 [N, K], fp32 scale [N]
    y = linear(x, w8)                              # x [M, K] fp32 -> [M, N] fp32
    e = embedding(ids, w8.qweight, w8.scale)       # rows of the dequantized weight

Weights: w[n, :] ~= scale[n] * qweight[n, :], scale[n] = max|w[n, :]| / 127, qweight in
[-127, 127]. The matmul is `csrc/int8_linear_cpu.c` (C + OpenMP, AVX-512 FMAs over int8
weights widened in registers; compiled at first use through `kernels/cpu_build.py`): it reads
a quarter of the fp32 bytes, which is what a decode step of a few streams is bound by. A row's
result does not depend on the other rows of the batch. Without a C compiler, `linear`
dequantizes and calls F.linear (correct, slow).

Why weight-only (measured on this project's 2-core AVX-512 machine, docs/benchmarks.md
"int8"): PyTorch's fbgemm dynamic-quantized linear (`quantized::linear_dynamic`, per-channel
qint8 weights) was the fastest kernel at every batch size (3-6x fp32 at M=1, 2-3x at M=64),
but it quantizes activations per tensor: perplexity of the test text went 18.27 -> 48.2.
Per-token int8 activations (simulated) still gave +3.2%, over the 2% budget; weight-only
int8 gives +1.6%. oneDNN's quantized linear has the same per-tensor activations and was
slower than fbgemm; `torch._weight_int8pack_mm` is vectorised for bf16 activations only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.cpu_build import build_library, find_compiler

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "int8_linear_cpu.c"
# (compile flags, link flags), tried in order. Never -ffast-math (see cpu_build.py).
FLAG_SETS = (
    (("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)),
    (("-O3", "-fopenmp"), ("-fopenmp",)),
)
K_MULTIPLE = 16
"""The C kernel walks K in steps of 16 floats."""


class Int8Weight(NamedTuple):
    """A linear layer's weight in int8 (symmetric per output channel)."""

    qweight: torch.Tensor
    """[N, K] int8 in [-127, 127], contiguous."""
    scale: torch.Tensor
    """[N] float32: w[n, :] ~= scale[n] * qweight[n, :]."""
    bias: torch.Tensor | None
    """[N] float32 or None."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self if t is not None)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (qweight [N, K] int8 in [-127, 127], scale [N] float32).

    Symmetric per output channel (row): scale[n] = max|w[n, :]| / 127 (1 for an all-zero row).
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return qweight.contiguous(), scale.contiguous()


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Weight:
    """A linear layer's fp32 weight [N, K] (and bias [N]) -> Int8Weight.

    Raises:
        ValueError: not a 2-D CPU weight.
    """
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"quantize_linear needs a 2-D CPU weight, got {tuple(weight.shape)} "
                         f"on {weight.device}")
    qweight, scale = quantize_weight(weight)
    b = None if bias is None else bias.detach().float().contiguous()
    return Int8Weight(qweight, scale, b)


@functools.cache
def load_kernel():
    """Compiles and loads `csrc/int8_linear_cpu.c`; None when it cannot be built here."""
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler found; int8 linear layers dequantize (slow)")
        return None
    with tempfile.TemporaryDirectory(prefix="pdserve-kernels-") as build_dir:
        library = build_library(compiler, SOURCE, [], FLAG_SETS, Path(build_dir))
        if library is None:
            logger.warning("could not compile %s; int8 linear layers dequantize (slow)",
                           SOURCE)
            return None
        lib = ctypes.CDLL(str(library))  # dlopen maps the file: the directory may go
    fn = lib.int8_linear_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x [M, K] float32 CPU -> x @ (scale * qweight).T + bias, [M, N] float32."""
    num_rows, k = x.shape
    n = w.qweight.shape[0]
    kernel = load_kernel() if k % K_MULTIPLE == 0 and x.dtype == torch.float32 else None
    if kernel is not None:
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(num_rows, n, dtype=torch.float32)
        if num_rows == 0:
            return out
        rc = kernel(x.data_ptr(), x.stride(0), w.qweight.data_ptr(), w.scale.data_ptr(),
                    None if w.bias is None else w.bias.data_ptr(), out.data_ptr(),
                    num_rows, n, k, torch.get_num_threads())
        if rc == 0:
            return out
    return F.linear(x.float(), w.qweight.float() * w.scale[:, None], w.bias)


def embedding(input_ids: torch.Tensor, qweight: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
    """input_ids [T] int64 -> [T, H] float32: the rows of scale * qweight."""
    return qweight[input_ids].float().mul_(scale[input_ids, None])
