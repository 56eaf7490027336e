"""fp32 linear layers on CPU from weights packed once into K-major panels
(`csrc/f32_gemv_cpu.c`): a bandwidth-bound GEMV for the 1-8 rows of a decode step of a few
streams, and a register-blocked GEMM over the same panels for more rows (prefill, large
batches), so an engine holds each weight once, in this layout only.

    w = pack_weight(layer.weight, layer.bias)      # once, after loading: GemvWeight
    y = linear(x, w)                               # x [M, K] fp32, any M

A matmul of M rows reads each 4-byte weight once for 2*M flops, so at small M its time is the
weight read. oneDNN's prepacked kernels (`kernels/cpu_linear.py`) read the model's 538 MB of
weights per step at about 20 GB/s on this project's 2-core AVX-512 machines, against the
27-29 GB/s the memory gives. The GEMV streams whole panels front to back per OpenMP thread,
with software prefetch ahead of the loads; rows run in tiles of 4, and a panel read again by
the next tile comes from L2 (1 thread, this kernel / oneDNN: 0.60 at M=1, 0.58 at M=4, 0.70
at M=8).

Past MAX_ROWS rows the GEMM blocks as BLIS does (Van Zee & van de Geijn, 2015): a 6-row x
64-column register tile (24 zmm accumulators) walks a 256-deep slice of K from L1/L2, rows
in blocks of up to 96 and panels split between threads. Its time against oneDNN's own
prepacked GEMM in one process on these machines: 0.84-1.04x over SmolLM2's shapes (M=9..2048),
0.93-1.06x over a 1B Llama's; so oneDNN's second copy of the weights is not kept.

Every output is one fp32 FMA chain over k in order and the bias is added last, in both
kernels, so a row's result does not depend on the other rows or on which kernel ran
(batch-invariant: a request gives the same bits alone or batched, at any M). Results differ
from `F.linear` and oneDNN by fp32 rounding only (another summation order).
Source: the layout is llama.cpp's / ggml's "repacked" CPU weights idea applied to fp32; the
bandwidth argument is the roofline model (Williams et al., 2009).

bf16 weights (`--dtype bfloat16`) run `csrc/bf16_gemm_cpu.c` on CPUs with AVX512-BF16:
panels whose k steps come in pairs ([ceil(N / PANEL), K / 2, PANEL, 2]), one VDPBF16PS per
pair of k against a broadcast pair of bf16 inputs, fp32 accumulation: half fp32's bytes per
weight and half its instructions per multiply-add. The same GEMV / GEMM split and the same
batch invariance hold.

Set PDSERVE_CPU_GEMV=0 to use oneDNN (prepacked) instead. Without a C compiler or AVX-512
`load_kernel` returns None and callers keep oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import NamedTuple

import torch

from pdserve.kernels import cpu_features
from pdserve.kernels.cpu_build import load_library

SOURCE = Path(__file__).parent / "csrc" / "f32_gemv_cpu.c"
BF16_SOURCE = Path(__file__).parent / "csrc" / "bf16_gemm_cpu.c"
PANEL = 64
"""Output channels per K-major panel (256 bytes of weights per k step)."""
PREFETCH_AHEAD = 2048
"""Bytes ahead of the current k step that the kernel prefetches."""
MAX_ROWS = 8
"""The most rows the GEMV runs; larger inputs run the GEMM."""
BF16_GEMM_KC = 1024
"""The bf16 GEMM's K slice (-DGEMM_KC): a slice of a 64-wide bf16 panel is 128 KiB, in L2;
the fp32 GEMM keeps its 256 (the partial sums of longer K go through memory)."""
# (compile flags, link flags), tried in order. Never -ffast-math (see cpu_build.py).
_DEFINES = (f"-DPANEL={PANEL}", f"-DPREFETCH_AHEAD={PREFETCH_AHEAD}", f"-DMAX_ROWS={MAX_ROWS}")
FLAG_SETS = ((("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)),)


class GemvWeight(NamedTuple):
    """A linear layer's weight packed for the kernel:

        float32:  wpacked[p, k, c] = W[PANEL * p + c, k]            (rows past N are zeros)
        bfloat16: wpacked[p, j, c, h] = W[PANEL * p + c, 2 * j + h]  (k in pairs, K even)
    """

    wpacked: torch.Tensor
    """[ceil(N / PANEL), K, PANEL] float32 or [ceil(N / PANEL), K / 2, PANEL, 2] bfloat16,
    contiguous."""
    bias: torch.Tensor | None
    """[PANEL * ceil(N / PANEL)] float32, or None for a layer without bias."""
    out_features: int
    """N."""


def is_enabled() -> bool:
    """PDSERVE_CPU_GEMV is not "0" (the switch for A/B runs and debugging)."""
    return os.environ.get("PDSERVE_CPU_GEMV", "1") != "0"




@functools.cache
def load_kernel(weight_dtype: torch.dtype = torch.float32):
    """Compiles and loads `csrc/f32_gemv_cpu.c` for fp32 weights or `csrc/bf16_gemm_cpu.c`
    for bf16 ones; None without a compiler or AVX-512 (the portable C loop is slower than
    oneDNN, so it is not used), for bf16 without AVX512-BF16, or for another dtype."""
    if weight_dtype not in (torch.float32, torch.bfloat16):
        return None
    bf16 = weight_dtype == torch.bfloat16
    source = BF16_SOURCE if bf16 else SOURCE
    usable = cpu_features.has_bf16_instructions() if bf16 else cpu_features.has_avx512()
    defines = (*_DEFINES, f"-DGEMM_KC={BF16_GEMM_KC}") if bf16 else _DEFINES
    lib = load_library(source, defines, FLAG_SETS) if usable else None
    prefix = "bf16_" if bf16 else "f32_"
    if lib is None or not all(hasattr(lib, prefix + name)
                              for name in ("gemv", "gemm", "gemv_panel")):
        return None
    if getattr(lib, prefix + "gemv_panel")() != PANEL:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fns = []
    for name in ("gemv", "gemm"):
        fn = getattr(lib, prefix + name)
        # bf16: x, x_stride, wpacked, bias, y (fp32), y16 (bf16 or NULL), M, N, K, threads
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, *((ptr,) if bf16 else ()), i64, i64, i64,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
        fns.append(fn)
    return _Kernels(*fns)


class _Kernels(NamedTuple):
    gemv: object
    """f32_gemv: 1..MAX_ROWS rows, weight-bandwidth bound."""
    gemm: object
    """f32_gemm: any number of rows, register-blocked; bit-identical to gemv."""


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> GemvWeight:
    """weight [N, K] float CPU (bias [N]) -> GemvWeight with panels in `dtype` (float32, or
    bfloat16 in k pairs: round to nearest even, exact for a bf16 weight); a copy of about
    N*K*4 (2) bytes. The bias stays fp32.

    Raises:
        ValueError: not a 2-D floating CPU weight, another panel dtype, or bf16 with odd K.
    """
    if (weight.dim() != 2 or not weight.dtype.is_floating_point
            or weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"pack_weight needs a 2-D float32 or bfloat16 CPU weight packed to "
                         f"either, got {tuple(weight.shape)} {weight.dtype} on "
                         f"{weight.device} to {dtype}")
    n, k = weight.shape
    if dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"bf16 panels pair the input features: K must be even, got {k}")
    n_pad = -(-n // PANEL) * PANEL
    padded = torch.zeros(n_pad, k, dtype=dtype)
    padded[:n] = weight.detach()
    if dtype == torch.bfloat16:
        wpacked = padded.view(n_pad // PANEL, PANEL, k // 2, 2).transpose(1, 2).contiguous()
    else:
        wpacked = padded.view(n_pad // PANEL, PANEL, k).transpose(1, 2).contiguous()
    bias_pad = None
    if bias is not None:
        bias_pad = torch.zeros(n_pad)
        bias_pad[:n] = bias.detach().float()
    return GemvWeight(wpacked, bias_pad, n)


def unpack_weight(w: GemvWeight) -> torch.Tensor:
    """GemvWeight -> the weight [N, K] it was packed from, in the panels' dtype."""
    return rows(w, torch.arange(w.out_features))


def in_features(w: GemvWeight) -> int:
    """K of a packed weight (either layout)."""
    return w.wpacked.shape[1] * (2 if w.wpacked.dim() == 4 else 1)


def rows(w: GemvWeight, ids: torch.Tensor) -> torch.Tensor:
    """W[ids] gathered from the panels: ids [T] int64 (each < N) -> [T, K] in the panels'
    dtype (an embedding lookup in a tied LM head's panels; the same bits as the plain rows)."""
    panel, chan = ids // PANEL, ids % PANEL
    if w.wpacked.dim() == 4:
        return w.wpacked[panel, :, chan, :].reshape(ids.shape[0], in_features(w))
    return w.wpacked[panel, :, chan]


def linear(x: torch.Tensor, w: GemvWeight,
           out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """x [M, K] float32 or bfloat16 CPU, M >= 0 -> x @ W.T + bias, [M, N] in out_dtype
    (default x's dtype; float32 keeps the fp32 sums unrounded, as logits want); None
    when the kernel does not take this input (another dtype, no kernel here). fp32 panels:
    fp32 products and sums (a bf16 x widened exactly). bf16 panels: bf16 x bf16 products (an
    fp32 x rounded to bf16 first, as oneDNN's bf16 matmul does) summed in fp32, the result
    rounded once to x's dtype. 1..MAX_ROWS rows run the bandwidth-bound GEMV, more the
    register-blocked GEMM over the same panels; both give the same bits for a row whatever
    M is."""
    num_rows, k = x.shape
    if x.dtype not in (torch.float32, torch.bfloat16):
        return None
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if num_rows == 0:
        return x.new_empty(0, w.out_features, dtype=out_dtype)
    kernels = load_kernel(w.wpacked.dtype)
    if kernels is None:
        return None
    if x.dtype != w.wpacked.dtype:
        x = x.to(w.wpacked.dtype)
    gemv = num_rows <= MAX_ROWS
    kernel = kernels.gemv if gemv else kernels.gemm
    if x.stride(1) != 1:
        x = x.contiguous()
    bias_ptr = w.bias.data_ptr() if w.bias is not None else None
    shape, threads = (num_rows, w.out_features), torch.get_num_threads()
    if w.wpacked.dtype == torch.bfloat16:
        # The kernel rounds to bf16 itself; its fp32 y holds only the partial sums of a
        # GEMM whose K spans more than one slice.
        out = torch.empty(shape, dtype=out_dtype)
        bf16_out = out_dtype == torch.bfloat16
        scratch = (torch.empty(shape) if bf16_out and not gemv and k > BF16_GEMM_KC
                   else None if bf16_out else out)
        status = kernel(x.data_ptr(), x.stride(0), w.wpacked.data_ptr(), bias_ptr,
                        scratch.data_ptr() if scratch is not None else None,
                        out.data_ptr() if bf16_out else None, *shape, k, threads)
        return out if status == 0 else None
    out = torch.empty(shape, dtype=torch.float32)
    if kernel(x.data_ptr(), x.stride(0), w.wpacked.data_ptr(), bias_ptr, out.data_ptr(),
              *shape, k, threads) != 0:
        return None
    return out if out_dtype == torch.float32 else out.to(torch.bfloat16)
