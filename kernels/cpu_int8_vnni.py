"""int8 x int8 (W8A8) linear on CPUs with AVX-512 VNNI, for every batch size: `cpu_int8.linear`
runs `w8a8` layers through it (decode batches of any size, prefill chunks).

    wv = pack_weight(qpacked)  # once at load (`cpu_int8.quantize_linear(..., w8a8=True)`)
    y = linear(x, w8)          # x [M, K] fp32, w8 a cpu_int8.Int8Weight -> [M, N] fp32, or None

Activations are quantized dynamically per row in blocks of `BLOCK` consecutive k, symmetric
(llama.cpp's Q8_0: d = max|x| / 127, q = round(x / d) in [-127, 127]; `quantize_activations`
is the same in torch); the weights are the per-output-channel int8 of `cpu_int8`, packed once
at load in the layout the kernel's tiles read (`pack_weight`: 4 k of a channel per int32
lane, offset to uint8). Each block's int32 dot products come from vpdpbusd (Intel AVX-512
VNNI, `_mm512_dpbusd_epi32`; ggml `ggml_vec_dot_q8_0_q8_0` is the same arithmetic),
accumulated in fp32: acc += dot * d[row, block], then y = acc * scale[n] + bias[n]. A row's
result does not depend on the other rows of the call; NaN / inf in a row's activations come
out as NaN / inf in its outputs. See `csrc/int8_vnni_cpu.c` for the tiles and the schedule.

Measured (2026-12-02, loaded 2-core AVX-512 VNNI machine, 30 layers' o/gate_up/down, medians
of 7 interleaved, 1 thread CPU time): this kernel / fp32 oneDNN 0.18 (M=1), 0.28 (4),
0.29 (16), 0.35 (64), 0.43 (256), 0.38 (2048), about 125 GMAC/s from M=8 up (vpdpbusd peak
~155); against the previous kernel (weights re-packed per call) 0.73-0.92 from M=16 up, but
1.05-1.15 at M=1-4 with the weights streamed from DRAM (not understood; 0.83 at M=1 when
they sit in L3). 16-bit activations (`a16`) on the qkv shape: 0.45-0.66x the time of the
weight-only kernel at M=1-2048; perplexity on tests/data with qkv_proj in a16 and the rest
W8A8: +1.80% vs fp32 (qkv weight-only: +1.76%; a16 in blocks of 64: +2.02%).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.kernels.cpu_build import load_library

if TYPE_CHECKING:
    from pdserve.kernels.cpu_int8 import Int8Weight

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "int8_vnni_cpu.c"
# Only -march=native can enable VNNI; never -ffast-math (see cpu_build.py).
FLAG_SETS = ((("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)),)
BLOCK = 32
"""Activation quantization block along K (Q8_0's 32); K must be a multiple of it."""
PANEL = 32
"""Output channels per packed panel (`cpu_int8.PANEL`)."""
A16_MAX = 32639
"""16-bit activations: v = round(x / d) in [-A16_MAX, A16_MAX], d = max|x| / A16_MAX per block,
run as two int8 halves (v = 256 * high + low, 127 * 257 the largest such v)."""



@functools.cache
def load_kernel():
    """Compiles and loads `csrc/int8_vnni_cpu.c`; None without a compiler, without AVX-512
    VNNI at compile time (no -march=native) or on a CPU that lacks it at run time."""
    lib = load_library(SOURCE, [], FLAG_SETS)
    if lib is None or not lib.int8_vnni_available():
        logger.info("no AVX-512 VNNI kernel here; int8 layers stay weight-only")
        return None
    fn = lib.int8_vnni_linear_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def pack_weight(qpacked: torch.Tensor) -> torch.Tensor:
    """`cpu_int8` panels [P, K, 32] int8 (K % 4 == 0) -> the kernel's layout, a new tensor:

        wv[p, k // 4, c, k % 4] = qpacked[p, k, c] + 128      [P, K / 4, 32, 4] uint8
    """
    p, k, c = qpacked.shape
    wv = qpacked.view(p, k // 4, 4, c).permute(0, 1, 3, 2).contiguous()
    return wv.view(torch.uint8).bitwise_xor_(0x80)  # two's complement q + 128


def unpack_weight(wv: torch.Tensor) -> torch.Tensor:
    """`pack_weight`'s inverse: [P, K / 4, 32, 4] uint8 -> [P, K, 32] int8."""
    p, k4, c, _ = wv.shape
    q = wv.bitwise_xor(0x80).view(torch.int8)
    return q.permute(0, 1, 3, 2).reshape(p, k4 * 4, c)


def linear(x: torch.Tensor, w: Int8Weight, block: int = BLOCK, act_bits: int = 8
           ) -> torch.Tensor | None:
    """x [M, K] float32 CPU -> [M, N] float32, the product with activations quantized per
    row and `block` of k to `act_bits` (8: W8A8; 16: two int8 halves, two vpdpbusd each);
    None when this path does not apply (no VNNI kernel, weights not packed by `pack_weight`,
    x not fp32, K % block != 0, or block not a multiple of 16): the caller then runs the
    weight-only path."""
    num_rows, k = x.shape
    kernel = load_kernel() if x.dtype == torch.float32 and w.qpacked.dim() == 4 else None
    if kernel is None or block <= 0 or block % 16 or k % block:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(num_rows, w.out_features, dtype=torch.float32)
    if num_rows == 0:
        return out
    rc = kernel(x.data_ptr(), x.stride(0), w.qpacked.data_ptr(), w.scale.data_ptr(),
                w.bias.data_ptr(), out.data_ptr(), num_rows, w.out_features, k, block,
                act_bits, torch.get_num_threads())
    return out if rc == 0 else None


def quantize_activations(x: torch.Tensor, block: int = BLOCK, act_bits: int = 8
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: x [M, K] float32 (K % block == 0) ->
    (q [M, K] in [-qmax, qmax], d [M, K / block] float32), x ~= q * d per block; qmax = 127
    (int8) for 8 bits, A16_MAX (int16) for 16.

    d = max|x| / qmax over the block; q = round_half_even(x * (1 / d)); d = 0 and q = 0 where
    max|x| < FLT_MIN. A block holding NaN: d = NaN, q = 0; holding +-inf (no NaN): d = +inf,
    q = +-127 (times 256 for 16 bits) at the infinities and 0 elsewhere.
    """
    qmax, inf_q = (127, 127) if act_bits == 8 else (A16_MAX, 127 * 256)
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(dim=2)
    has_nan = xb.isnan().any(dim=2)
    special = has_nan | amax.isinf()
    tiny = amax < torch.finfo(torch.float32).tiny
    d = torch.where(tiny, torch.zeros_like(amax), amax / float(qmax))
    d = torch.where(has_nan, torch.full_like(d, float("nan")), d)
    safe = torch.where(tiny | special, torch.ones_like(d), d)
    inv = torch.where(tiny | special, torch.zeros_like(d), 1.0 / safe)
    q = torch.round(torch.nan_to_num(xb * inv[:, :, None], nan=0.0)).clamp_(-qmax, qmax)
    at_inf = torch.where(xb.isinf(), xb.sign() * inf_q, torch.zeros_like(xb))
    q = torch.where(special[:, :, None], at_inf, q)
    q = q.to(torch.int8 if act_bits == 8 else torch.int16)
    return q.reshape(m, k), d
