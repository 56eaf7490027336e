"""int8 linear layers and embeddings on CPU (`--quantization int8`): weights quantized once at
load time, symmetric per output channel; activations fp32 (weight-only int8), or, for layers
quantized with `w8a8=True` on a CPU with AVX-512 VNNI, int8 too (`cpu_int8_vnni`).

    w8 = quantize_linear(weight, bias)             # Int8Weight (panels of 32 channels)
    y = linear(x, w8)                              # x [M, K] fp32 -> [M, N] fp32
    e = embedding(ids, w8)                         # rows of the dequantized weight

Weights: w[n, :] ~= scale[n] * q[n, :], scale[n] = max|w[n, :]| / 127, q in [-127, 127],
stored as K-major panels of 32 output channels (`Int8Weight.qpacked`). The weight-only matmul
is `csrc/int8_linear_cpu.c` (C + OpenMP, AVX-512 FMAs over int8 weights widened to fp32;
compiled at first use through `kernels/cpu_build.py`): with up to 4 rows it reads the weights
as int8 only, a quarter of the fp32 bytes, which is what a decode step of a few streams is
bound by; with more rows each panel is widened once into a per-thread fp32 buffer and run as
a 12-row x 32-column register-blocked GEMM. Every output is the same fp32 FMA chain over k
whatever the batch, so a row's result does not depend on the other rows. Without a C compiler
`linear` dequantizes and calls F.linear (correct, slow). The W8A8 path (`cpu_int8_vnni`,
llama.cpp Q8_0-style activations per row and block of 32 k, vpdpbusd int32 dots) reads the
weights packed once at load in the layout its tiles read (`cpu_int8_vnni.pack_weight`).

Why weight-only (measured on this project's 2-core AVX-512 machine, docs/benchmarks.md
"int8"; the 30 layers' matmuls, ms: M=1 fp32 26.2, this kernel 5.4, fbgemm 7.3; M=64 77.9,
73.8, 24.9): PyTorch's fbgemm dynamic-quantized linear (`quantized::linear_dynamic`,
per-channel qint8 weights) is the fastest from M=4 up, but it quantizes activations per
tensor: perplexity of the test text went 18.27 -> 48.2.
Per-token int8 activations (simulated) still gave +3.2%, over the 2% budget; weight-only
int8 gives +1.6%. oneDNN's quantized linear has the same per-tensor activations and was
slower than fbgemm; `torch._weight_int8pack_mm` is vectorised for bf16 activations only.
Per-block (32 k) int8 activations on every layer (`cpu_int8_vnni`) give +2.7%, nearly all
from the attention input (qkv); on every layer but qkv +1.8% (docs/engine-contracts.md):
hence the per-layer `w8a8` flag.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_int8_vnni
from pdserve.kernels.cpu_build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "int8_linear_cpu.c"
# (compile flags, link flags), tried in order. Never -ffast-math (see cpu_build.py).
FLAG_SETS = (
    (("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)),
    (("-O3", "-fopenmp"), ("-fopenmp",)),
)
PANEL = 32
"""Output channels per K-major weight panel (the C kernel's tile width)."""


class Int8Weight(NamedTuple):
    """A linear layer's weight in int8 (symmetric per output channel), packed for the kernel.

        qpacked[p, k, c] = q[32 * p + c, k]      (rows past N are zeros)

    or, for a `w8a8` layer where the VNNI kernel runs, that kernel's layout
    (`cpu_int8_vnni.pack_weight`): qpacked[p, k // 4, c, k % 4] = q[32 * p + c, k] + 128.
    """

    qpacked: torch.Tensor
    """[ceil(N / 32), K, 32] int8 in [-127, 127], or [ceil(N / 32), K / 4, 32, 4] uint8 in
    [1, 255] (VNNI layout), contiguous."""
    scale: torch.Tensor
    """[32 * ceil(N / 32)] float32: w[n, :] ~= scale[n] * q[n, :] (1 past N)."""
    bias: torch.Tensor
    """[32 * ceil(N / 32)] float32 (zeros for a layer without bias)."""
    out_features: int
    """N."""
    w8a8: bool = False
    """Quantize the activations too (`cpu_int8_vnni`, AVX-512 VNNI CPUs): set per layer by
    `quantize_linear(..., w8a8=True)`; False keeps fp32 activations (weight-only)."""
    a16: bool = False
    """(Not w8a8) 16-bit activations per block (`cpu_int8_vnni`, two int8 halves): about
    weight-only int8's accuracy at integer speed; set by `quantize_linear(..., a16=True)`."""

    def panels(self) -> torch.Tensor:
        """[ceil(N / 32), K, 32] int8: `qpacked` in the weight-only layout (a view, or a copy
        from the VNNI layout)."""
        if self.qpacked.dim() == 4:
            return cpu_int8_vnni.unpack_weight(self.qpacked)
        return self.qpacked

    def int_weight(self) -> torch.Tensor:
        """[N, K] int8: q."""
        qpacked = self.panels()
        num_panels, k, _ = qpacked.shape
        return qpacked.transpose(1, 2).reshape(num_panels * PANEL, k)[:self.out_features]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: scale * q."""
        return self.int_weight().float() * self.scale[:self.out_features, None]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (qweight [N, K] int8 in [-127, 127], scale [N] float32).

    Symmetric per output channel (row): scale[n] = max|w[n, :]| / 127 (1 for an all-zero row).
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return qweight.contiguous(), scale.contiguous()


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                    w8a8: bool = False, a16: bool = False) -> Int8Weight:
    """A linear layer's fp32 weight [N, K] (and bias [N]) -> Int8Weight; `w8a8`: run it with
    int8 activations where the CPU has VNNI (`cpu_int8_vnni`; the weights are then stored in
    its layout when K is a multiple of its block, else the layer stays weight-only); `a16`
    (without w8a8): with 16-bit activations there, the same way.

    Raises:
        ValueError: not a 2-D CPU weight.
    """
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"quantize_linear needs a 2-D CPU weight, got {tuple(weight.shape)} "
                         f"on {weight.device}")
    qweight, scale = quantize_weight(weight)
    n, k = qweight.shape
    n_pad = -(-n // PANEL) * PANEL
    padded = torch.zeros(n_pad, k, dtype=torch.int8)
    padded[:n] = qweight
    qpacked = padded.view(n_pad // PANEL, PANEL, k).transpose(1, 2).contiguous()
    scale_pad = torch.ones(n_pad)
    scale_pad[:n] = scale
    bias_pad = torch.zeros(n_pad)
    if bias is not None:
        bias_pad[:n] = bias.detach().float()
    a16 = a16 and not w8a8
    if (w8a8 or a16) and k % cpu_int8_vnni.BLOCK == 0 and cpu_int8_vnni.load_kernel():
        qpacked = cpu_int8_vnni.pack_weight(qpacked)
    return Int8Weight(qpacked, scale_pad, bias_pad, n, w8a8, a16)


@functools.cache
def load_kernel():
    """Compiles and loads `csrc/int8_linear_cpu.c` (and the W8A8 `cpu_int8_vnni` kernel);
    None when it cannot be built here."""
    cpu_int8_vnni.load_kernel()
    lib = load_library(SOURCE, [], FLAG_SETS)
    if lib is None:
        logger.warning("could not build %s; int8 linear layers dequantize (slow)", SOURCE)
        return None
    fn = lib.int8_linear_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x [M, K] float32 CPU -> x @ (scale * q).T + bias, [M, N] float32.

    A `w.w8a8` layer packed for the VNNI kernel quantizes the activations too, int8 per row
    and block of 32 k (`cpu_int8_vnni.linear`), at every batch size (`w.a16`: to 16 bits);
    otherwise weight-only."""
    num_rows, k = x.shape
    n = w.out_features
    if w.qpacked.dim() == 4:  # VNNI layout: no weight-only kernel reads it
        out = None
        if w.w8a8:
            out = cpu_int8_vnni.linear(x, w)
        elif w.a16:
            out = cpu_int8_vnni.linear(x, w, act_bits=16)
        if out is not None:
            return out
        return F.linear(x.float(), w.dequantize(), w.bias[:n])
    kernel = load_kernel() if x.dtype == torch.float32 else None
    if kernel is not None:
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(num_rows, n, dtype=torch.float32)
        if num_rows == 0:
            return out
        rc = kernel(x.data_ptr(), x.stride(0), w.qpacked.data_ptr(), w.scale.data_ptr(),
                    w.bias.data_ptr(), out.data_ptr(), num_rows, n, k, torch.get_num_threads())
        if rc == 0:
            return out
    return F.linear(x.float(), w.dequantize(), w.bias[:n])


def embedding(input_ids: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """input_ids [T] int64 -> [T, K] float32: the rows of scale * q (gathered from panels)."""
    if w.qpacked.dim() == 4:  # VNNI layout: [T, K / 4, 4] uint8, q + 128
        q = w.qpacked[input_ids // PANEL, :, input_ids % PANEL, :]
        q = q.reshape(len(input_ids), -1).bitwise_xor(0x80).view(torch.int8)
    else:
        q = w.qpacked[input_ids // PANEL, :, input_ids % PANEL]  # [T, K]
    return q.float().mul_(w.scale[input_ids, None])
