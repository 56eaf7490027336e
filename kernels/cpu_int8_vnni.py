"""int8 x int8 (W8A8) linear for many rows on CPUs with AVX-512 VNNI: `cpu_int8.linear` uses
it from `MIN_ROWS` rows up (decode batches, prefill chunks); fewer rows keep the weight-only
kernel, which reads the int8 weights at memory bandwidth.

    y = linear(x, w8)        # x [M, K] fp32, w8 a cpu_int8.Int8Weight -> [M, N] fp32, or None

Activations are quantized dynamically per row in blocks of `BLOCK` consecutive k, symmetric
(llama.cpp's Q8_0: d = max|x| / 127, q = round(x / d) in [-127, 127]; `quantize_activations`
is the same in torch); the weights are the per-output-channel int8 of `cpu_int8`, unchanged in
memory. Each block's int32 dot products come from vpdpbusd (Intel AVX-512 VNNI,
`_mm512_dpbusd_epi32`; ggml `ggml_vec_dot_q8_0_q8_0` is the same arithmetic), accumulated in
fp32: acc += dot * d[row, block], then y = acc * scale[n] + bias[n]. See
`csrc/int8_vnni_cpu.c` for the layout and the unsigned-by-signed offset. A row's result does
not depend on the other rows of the call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels.cpu_build import build_library, find_compiler

if TYPE_CHECKING:
    from kernels.cpu_int8 import Int8Weight

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "int8_vnni_cpu.c"
# Only -march=native can enable VNNI; never -ffast-math (see cpu_build.py).
FLAG_SETS = ((("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)),)
DEFINES: list[str] = []
BLOCK = 32
"""Activation quantization block along K (Q8_0's 32); K must be a multiple of it."""
MIN_ROWS = 1
"""Rows from which `cpu_int8.linear` takes this path for a `w8a8` layer: with 1-16 rows the
kernel reads each panel once as stored (re-packed in registers), as fast as the weight-only
kernel at 1 row and faster from 2 (single-thread micro-timings, docs/engine-contracts.md);
from 1, a row's result does not depend on the batch size either."""
MIN_ROWS_ENV = "PDSERVE_INT8_W8A8_MIN_ROWS"
"""Overrides MIN_ROWS (e.g. a huge value: weight-only int8 at every batch size, for A/B)."""


def min_rows() -> int:
    """MIN_ROWS, or the integer in $PDSERVE_INT8_W8A8_MIN_ROWS when set."""
    value = os.environ.get(MIN_ROWS_ENV, "").strip()
    return int(value) if value else MIN_ROWS


@functools.cache
def load_kernel():
    """Compiles and loads `csrc/int8_vnni_cpu.c`; None without a compiler, without AVX-512
    VNNI at compile time (no -march=native) or on a CPU that lacks it at run time."""
    compiler = find_compiler()
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory(prefix="pdserve-kernels-") as build_dir:
        library = build_library(compiler, SOURCE, DEFINES, FLAG_SETS, Path(build_dir))
        if library is None:
            logger.info("could not compile %s; int8 layers stay weight-only", SOURCE)
            return None
        lib = ctypes.CDLL(str(library))  # dlopen maps the file: the directory may go
    if not lib.int8_vnni_available():
        logger.info("no AVX-512 VNNI here; int8 layers stay weight-only")
        return None
    fn = lib.int8_vnni_linear_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def linear(x: torch.Tensor, w: Int8Weight, block: int = BLOCK) -> torch.Tensor | None:
    """x [M, K] float32 CPU -> [M, N] float32, the W8A8 product with `block`-wise activations;
    None when this path does not apply here (no VNNI kernel, not fp32, K % block != 0, or
    block not a multiple of 16): the caller then runs the weight-only kernel."""
    num_rows, k = x.shape
    kernel = load_kernel() if x.dtype == torch.float32 else None
    if kernel is None or block <= 0 or block % 16 or k % block:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(num_rows, w.out_features, dtype=torch.float32)
    if num_rows == 0:
        return out
    rc = kernel(x.data_ptr(), x.stride(0), w.qpacked.data_ptr(), w.scale.data_ptr(),
                w.bias.data_ptr(), out.data_ptr(), num_rows, w.out_features, k, block,
                torch.get_num_threads())
    return out if rc == 0 else None


def quantize_activations(x: torch.Tensor, block: int = BLOCK
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: x [M, K] float32 (K % block == 0) ->
    (q [M, K] int8 in [-127, 127], d [M, K / block] float32), x ~= q * d per block.

    d = max|x| / 127 over the block; q = round_half_even(x * (1 / d)), 0 where d == 0.
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    d = xb.abs().amax(dim=2) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)),
                      torch.zeros_like(d))
    q = torch.round(xb * inv[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(m, k), d
