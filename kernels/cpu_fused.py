"""Fused elementwise ops for the fp32 and bf16 CPU forward pass (`csrc/fused_cpu.c`), torch
ops otherwise.

silu_and_mul, rms_norm, fused_add_rms_norm and rotary_embedding, after vLLM's CPU ops of the
same names. Each replaces a chain of torch ops (and their temporaries) with one pass over
memory, and gives bit-identical results to that chain (see the C file's header): in fp32
the chain's fp32 ops, in bf16 torch's bf16 ops (each widened to fp32, rounded to bf16 once
per op, as `--dtype bfloat16` runs them).

The C file is compiled at first use, once per process, with the system C compiler and OpenMP,
then loaded with ctypes, as in `kernels/cpu_native.py`. Without a working compiler
`load_fused_kernels` returns None and every function here runs the equivalent torch ops.
The OpenMP thread count is `threads_for(...)`: `torch.get_num_threads()`, read on every call
(the engine may change it between steps), but one thread for inputs too small to split.
PDSERVE_FUSED_CPU=0 makes `load_model` keep the torch ops (A/B runs).
"""

import ctypes
import functools
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu_build import build_library
from pdserve.kernels.cpu_build import find_compiler as _find_compiler  # tests patch this name

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "fused_cpu.c"
# (compile flags, link flags), tried in order; the last set is the plainest.
# NOTE: -ffp-contract=off in every set: the results match torch's bit for bit only while no
# `a * b + c` is contracted into an FMA. Never -ffast-math: it would reorder the sums, and
# linked with it gcc adds crtfastmath.o, which sets flush-to-zero for the whole process.
# -fno-trapping-math only lets gcc vectorize the branch-free selects; it changes no result.
FLAG_SETS = (
    (("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
      "-fopenmp"), ("-fopenmp", "-lm")),
    (("-O3", "-ffp-contract=off", "-fopenmp"), ("-fopenmp", "-lm")),
)

_c_int64 = ctypes.c_int64
_c_ptr = ctypes.c_void_p
_c_int = ctypes.c_int


class FusedKernels(NamedTuple):
    """The compiled library's entry points (signatures in `csrc/fused_cpu.c`)."""

    silu_and_mul: Callable[..., None]
    rms_norm: Callable[..., None]
    fused_add_rms_norm: Callable[..., None]
    rotary_embedding: Callable[..., int]
    silu_and_mul_bf16: Callable[..., None]
    rms_norm_bf16: Callable[..., None]
    fused_add_rms_norm_bf16: Callable[..., None]
    rotary_embedding_bf16: Callable[..., int]

    def pick(self, name: str, dtype: torch.dtype) -> Callable[..., int | None]:
        """The entry point `name` for float32 or bfloat16 rows."""
        return getattr(self, name if dtype == torch.float32 else name + "_bf16")


MAX_BF16_ROW = 16384
"""The widest bf16 row the bf16 norms take (their fp32 copy of a row is on the stack)."""


def is_enabled() -> bool:
    """False when PDSERVE_FUSED_CPU=0: the model then keeps its plain torch ops (for A/B runs)."""
    return os.environ.get("PDSERVE_FUSED_CPU", "1") != "0"


def _build_defines() -> list[str]:
    # NOTE: the sums and exp match ATen's only at ATen's vector width for that kernel: on an
    # AVX-512 CPU, silu runs ATen's AVX-512 build (ALSO_REGISTER_AVX512_DISPATCH), sum its AVX2
    # build (plain REGISTER_DISPATCH); 8 floats is also the width of ATen's generic vectors.
    capability = torch.backends.cpu.get_cpu_capability()
    silu_lanes = 16 if capability == "AVX512" else 8
    defines = ["-DSUM_VEC_LANES=8", f"-DSILU_VEC_LANES={silu_lanes}"]
    if capability in ("AVX2", "AVX512"):
        defines.append("-DUSE_SLEEF_EXP")  # else ATen's exp is libm's, per element
    return defines


@functools.cache
def load_fused_kernels() -> FusedKernels | None:
    """Compiles and loads `csrc/fused_cpu.c`; None when it cannot be built here."""
    compiler = _find_compiler()
    if compiler is None:
        logger.info("no C compiler found; fused CPU ops run as torch ops")
        return None
    with tempfile.TemporaryDirectory(prefix="pdserve-kernels-") as build_dir:
        library = build_library(compiler, SOURCE, _build_defines(), FLAG_SETS,
                                Path(build_dir))
        if library is None:
            logger.warning("could not compile %s; fused CPU ops run as torch ops", SOURCE)
            return None
        # NOTE: dlopen maps the file, so the build directory can be removed right after.
        lib = ctypes.CDLL(str(library))
    fns = []
    for suffix in ("f32", "bf16"):
        silu = getattr(lib, "silu_and_mul_" + suffix)
        silu.restype = None
        silu.argtypes = [_c_ptr, _c_int64, _c_int64, _c_int64, _c_ptr, _c_int64, _c_int]
        norm = getattr(lib, "rms_norm_" + suffix)
        norm.restype = None
        norm.argtypes = [_c_ptr, _c_int64, _c_ptr, _c_int64, _c_int64, ctypes.c_float,
                         _c_ptr, _c_int64, _c_int]
        add_norm = getattr(lib, "fused_add_rms_norm_" + suffix)
        add_norm.restype = None
        add_norm.argtypes = [_c_ptr, _c_int64, _c_ptr, _c_int64, _c_ptr, _c_int64, _c_int64,
                             ctypes.c_float, _c_int]
        rotary = getattr(lib, "rotary_embedding_" + suffix)
        rotary.restype = ctypes.c_int
        rotary.argtypes = [
            _c_ptr, _c_int64,  # positions, num_tokens
            _c_ptr, _c_int64, _c_int64,  # q, q row stride, num_heads
            _c_ptr, _c_int64, _c_int64,  # k, k row stride, num_kv_heads
            _c_ptr, _c_ptr, _c_int64, _c_int64, _c_int,  # cos, sin, max_positions, head_dim,
        ]                                                # threads
        fns += [silu, norm, add_norm, rotary]
    return FusedKernels(*fns)


MIN_ELEMENTS_PER_THREAD = 16384
"""An elementwise kernel runs on one thread below this many elements per thread."""


def threads_for(num_rows: int, row_elements: int) -> int:
    """OpenMP threads for a kernel over `num_rows` rows of `row_elements` elements each: at
    most torch's thread count, at most one per row (a row is one thread's work), and at
    least MIN_ELEMENTS_PER_THREAD elements per thread.

    NOTE: a parallel region costs a fork and a join; with one row (a decode step of a single
    stream) the second thread has nothing to do, and when it is not on a core (another
    process's turn) the join waits for it: on the 2-core test machine, under load, a
    [1, 576] fused_add_rms_norm between two matmuls took 0.9 ms per pair with 2 threads
    against 0.3 ms with 1. Results do not depend on the count (each row is one thread's).
    """
    threads = torch.get_num_threads()
    by_work = max(1, (num_rows * row_elements) // MIN_ELEMENTS_PER_THREAD)
    return max(1, min(threads, num_rows, by_work))


def _check_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dtype in (torch.float32, torch.bfloat16) and t.device.type == "cpu", (
            t.dtype, t.device)
        assert t.dtype == tensors[0].dtype, "one dtype for all rows"
        assert t.dim() == 2 and t.stride(1) == 1, "rows must be contiguous"


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate, up = gate_up's first and last halves (vLLM's silu_and_mul).

    Args:
        gate_up: [num_tokens, 2 * d] float32 or bfloat16 on CPU, rows contiguous (the fused
            gate_up_proj output).

    Returns:
        [num_tokens, d] in gate_up's dtype, a new contiguous tensor; silu(x) = x / (1 +
        exp(-x)).
    """
    _check_rows(gate_up)
    assert gate_up.shape[1] % 2 == 0, gate_up.shape
    num_tokens, d = gate_up.shape[0], gate_up.shape[1] // 2
    kernels = load_fused_kernels()
    if kernels is None:
        gate, up = gate_up.split(d, dim=-1)
        return F.silu(gate) * up
    out = torch.empty(num_tokens, d, dtype=gate_up.dtype)
    kernels.pick("silu_and_mul", gate_up.dtype)(
        gate_up.data_ptr(), gate_up.stride(0), num_tokens, d, out.data_ptr(), out.stride(0),
        threads_for(num_tokens, 2 * d))
    return out


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    _check_rows(x)
    assert weight.dtype == x.dtype and weight.device.type == "cpu"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), (weight.shape, x.shape)


def _norm_kernels(x: torch.Tensor) -> FusedKernels | None:
    if x.dtype == torch.bfloat16 and x.shape[1] > MAX_BF16_ROW:
        return None
    return load_fused_kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as transformers computes it: weight * (x * rsqrt(mean(x^2)
    + eps)), the mean of squares in fp32 (vLLM's rms_norm).

    Args:
        x: [num_tokens, hidden] float32 or bfloat16 on CPU, rows contiguous (any row stride).
        weight: [hidden] in x's dtype, contiguous.
        eps: added to the mean of squares.

    Returns:
        [num_tokens, hidden] in x's dtype, a new contiguous tensor; x is not modified. bf16:
        the mean of squares and x * rsqrt(...) in fp32, rounded to bf16, times the weight
        rounded again (transformers' order).
    """
    _check_norm_args(x, weight)
    kernels = _norm_kernels(x)
    if kernels is None:
        return _rms_norm_torch(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    kernels.pick("rms_norm", x.dtype)(
        x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0], x.shape[1], eps,
        out.data_ptr(), out.stride(0), threads_for(x.shape[0], x.shape[1]))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place, as vLLM's fused_add_rms_norm: residual += x, then x = rms_norm(residual).

    Args:
        x: [num_tokens, hidden] float32 or bfloat16 on CPU, rows contiguous; overwritten
            with the normed sum.
        residual: same shape and dtype, not overlapping x; overwritten with residual + x.
        weight: [hidden] in x's dtype, contiguous.
        eps: added to the mean of squares.
    """
    _check_norm_args(x, weight)
    _check_rows(residual)
    assert residual.shape == x.shape, (residual.shape, x.shape)
    assert residual.data_ptr() != x.data_ptr(), "x and residual must be different tensors"
    kernels = _norm_kernels(x)
    if kernels is None:
        residual.add_(x)
        x.copy_(_rms_norm_torch(residual, weight, eps))
        return
    kernels.pick("fused_add_rms_norm", x.dtype)(
        x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
        x.shape[0], x.shape[1], eps, threads_for(x.shape[0], 2 * x.shape[1]))


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: x = x * cos[pos] + rotate_half(x) * sin[pos] for q and k (RoPE, Su et al. 2021,
    rotate-half / NeoX layout as HF Llama; vLLM's rotary_embedding with is_neox=True).

    Args:
        q: [num_tokens, num_heads, head_dim] float32 or bfloat16 on CPU; heads contiguous
            within a row, any row stride (a view into the qkv matmul output is fine).
        k: [num_tokens, num_kv_heads, head_dim], q's dtype and layout rules, not
            overlapping q.
        positions: [num_tokens] int64, contiguous; each in [0, max_positions).
        cos: [max_positions, head_dim] in q's dtype, contiguous: cos of cat(freqs, freqs)
            (bf16: each product and the sum rounded to bf16, as torch's bf16 ops).
        sin: same for sin.

    Raises:
        IndexError: a position is outside the tables (nothing is written).
    """
    head_dim = q.shape[2]
    num_tokens = positions.shape[0]
    for x in (q, k):
        assert x.dtype == q.dtype and x.device.type == "cpu", (x.dtype, x.device)
        assert x.dtype in (torch.float32, torch.bfloat16)
        assert x.dim() == 3 and x.shape[0] == num_tokens and x.shape[2] == head_dim, x.shape
        assert x.stride(2) == 1 and x.stride(1) == head_dim, "heads must be contiguous"
    assert head_dim % 2 == 0
    assert positions.dtype == torch.int64 and positions.dim() == 1 and positions.is_contiguous()
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == head_dim
    assert cos.dtype == sin.dtype == q.dtype
    assert cos.is_contiguous() and sin.is_contiguous()
    kernels = load_fused_kernels()
    if kernels is None:
        if num_tokens and not 0 <= int(positions.min()) <= int(positions.max()) < cos.shape[0]:
            raise IndexError("rotary_embedding position outside the cos/sin tables")
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        q.copy_(_rotate_torch(q, c, s))
        k.copy_(_rotate_torch(k, c, s))
        return
    status = kernels.pick("rotary_embedding", q.dtype)(
        positions.data_ptr(), num_tokens, q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(),
        k.stride(0), k.shape[1], cos.data_ptr(), sin.data_ptr(), cos.shape[0], head_dim,
        threads_for(num_tokens, (q.shape[1] + k.shape[1]) * head_dim))
    if status == -2:
        raise IndexError("rotary_embedding position outside the cos/sin tables")
