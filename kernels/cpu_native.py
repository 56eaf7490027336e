"""Builds, loads and calls the native CPU attention kernel (`csrc/paged_attention_cpu.c`).

The fast CPU path (`kernels/torch_paged.py`) sends decode rows here: one fused pass that reads
each request's K/V blocks straight from the paged cache, with no gathered copy and no padding.
The C file is compiled at first use, once per process and per (head_dim, num_kv_heads,
group_size), with the system C compiler (`$CC`, else `cc`/`gcc`) and OpenMP, then loaded with
ctypes. Without a working compiler `load_native_kernel` returns None and the caller falls back
to plain torch ops, so nothing here is required for correctness.

NOTE: the library links `libgomp.so.1`; torch's Linux wheels ship that same soname and load it
first, so the kernel's OpenMP threads are torch's intra-op threads (no oversubscription).
"""

import ctypes
import functools
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from pdserve.kernels.cpu_build import build_library
from pdserve.kernels.cpu_build import find_compiler as _find_compiler  # tests patch this name

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.c"
# (compile flags, link flags), tried in order: vectorized expf from libmvec needs -ffast-math;
# the last set is the plainest.
# NOTE: -ffast-math only when compiling, never when linking: linked with it, gcc adds
# crtfastmath.o, whose constructor turns on flush-to-zero / denormals-are-zero for the whole
# process when the library is loaded (it broke hypothesis' float strategies, and would change
# every other float computation in the process).
FLAG_SETS = (
    (("-O3", "-march=native", "-ffast-math", "-fopenmp"), ("-fopenmp", "-lmvec", "-lm")),
    (("-O3", "-march=native", "-fno-math-errno", "-fopenmp"), ("-fopenmp", "-lm")),
    (("-O3", "-fopenmp"), ("-fopenmp", "-lm")),
)

_c_int64 = ctypes.c_int64
_c_ptr = ctypes.c_void_p


class NativeKernel(NamedTuple):
    """A compiled kernel for one (head_dim, num_kv_heads, group_size)."""

    function: Callable[..., int]
    head_dim: int
    num_kv_heads: int
    group_size: int
    kv_dtype: torch.dtype = torch.float32
    """The cache's dtype: float32 or bfloat16."""


@functools.cache
def load_native_kernel(head_dim: int, num_kv_heads: int, group_size: int,
                       kv_dtype: torch.dtype = torch.float32) -> NativeKernel | None:
    """Compiles and loads the kernel for these shapes and a float32 or bfloat16 cache (the
    query and output in the cache's dtype, fp32 sums either way); None when it cannot be
    built here."""
    if kv_dtype not in (torch.float32, torch.bfloat16):
        return None
    compiler = _find_compiler()
    if compiler is None:
        logger.info("no C compiler found; CPU attention uses torch ops only")
        return None
    defines = (f"-DHEAD_DIM={head_dim}", f"-DNUM_KV_HEADS={num_kv_heads}",
               f"-DGROUP_SIZE={group_size}")
    bf16 = kv_dtype == torch.bfloat16
    if bf16:
        defines += ("-DKV_BF16",)
    with tempfile.TemporaryDirectory(prefix="pdserve-kernels-") as build_dir:
        library = build_library(compiler, SOURCE, defines, FLAG_SETS, Path(build_dir))
        if library is None:
            logger.warning("could not compile %s; CPU attention uses torch ops only", SOURCE)
            return None
        # NOTE: dlopen maps the file, so the build directory can be removed right after.
        lib = ctypes.CDLL(str(library))
        function = lib.paged_attention_rows_bf16 if bf16 else lib.paged_attention_rows_f32
    function.restype = ctypes.c_int
    function.argtypes = [
        _c_ptr, _c_int64, _c_int64,  # query, query_stride, num_tokens
        _c_ptr, _c_ptr, _c_int64, _c_int64,  # k_cache, v_cache, num_blocks, block_size
        _c_ptr, _c_int64, _c_int64, _c_int64,  # block_table, num_reqs, width, stride
        _c_ptr, _c_ptr, _c_ptr, _c_int64, _c_int64,  # query rows, batch indices, seq_lens, n, max
        ctypes.c_float, ctypes.c_int, ctypes.c_float,  # scale, sliding_window, soft_cap
        _c_ptr, _c_int64, ctypes.c_int,  # out, out_stride, threads
    ]
    return NativeKernel(function, head_dim, num_kv_heads, group_size, kv_dtype)


class DecodeRows(NamedTuple):
    """Query rows that each attend to a prefix of one request's keys (decodes, and the rows
    of speculative drafts): the native kernel's work list, all contiguous."""

    query_rows: torch.Tensor
    """[num_rows] int64: the query/out row of each."""
    batch_indices: torch.Tensor
    """[num_rows] int64: its request's batch index (row of block_table)."""
    seq_lens: torch.Tensor
    """[num_rows] int32: keys it attends to, 1 <= seq_len <= max_seq_len."""
    max_seq_len: int
    """Host int, max of seq_lens."""


def paged_attention_rows(
    kernel: NativeKernel,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: DecodeRows,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """out[rows.query_rows[r]] = attention of that query row over the first
    rows.seq_lens[r] keys of request rows.batch_indices[r] (only the last `sliding_window`
    of them when set; blocks before the window are not read). Writes only the listed rows.

    Args:
        kernel: from `load_native_kernel(head_dim, num_kv_heads, num_heads // num_kv_heads)`.
        query: [num_tokens, num_heads, head_dim] in `kernel.kv_dtype`, each row's heads
            contiguous (bf16: the scores are fp32 sums of exact bf16 products).
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim] in `kernel.kv_dtype`
            (float32 or bfloat16), contiguous.
        v_cache: same as k_cache.
        block_table: [num_reqs, max_num_blocks_per_req] int32, last dim contiguous.
        rows: the rows to compute.
        scale: softmax scale.
        out: [num_tokens, num_heads, head_dim] in `kernel.kv_dtype`, each row's heads
            contiguous (bf16: the fp32 result rounded once).
        sliding_window: None, or the number of most recent keys each row attends to.
        logits_soft_cap: None, or c: each scaled score s becomes c * tanh(s / c) (Gemma 2).

    Raises:
        IndexError: an index outside query, block_table or the cache (nothing written).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    assert (head_dim, k_cache.shape[2]) == (kernel.head_dim, kernel.num_kv_heads)
    assert num_heads == kernel.num_kv_heads * kernel.group_size
    assert query.dtype == out.dtype == k_cache.dtype == v_cache.dtype == kernel.kv_dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape == v_cache.shape and out.shape == query.shape
    for x in (query, out):
        assert x.stride(2) == 1 and x.stride(1) == head_dim, "heads must be contiguous"
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    query_rows, batch_indices, seq_lens, max_seq_len = rows
    assert query_rows.dtype == batch_indices.dtype == torch.int64
    assert seq_lens.dtype == torch.int32
    assert query_rows.is_contiguous() and batch_indices.is_contiguous()
    assert seq_lens.is_contiguous()
    tensors = (query, k_cache, v_cache, block_table, query_rows, batch_indices, seq_lens, out)
    assert all(t.device.type == "cpu" for t in tensors)
    num_rows = query_rows.shape[0]
    assert batch_indices.shape[0] == num_rows and seq_lens.shape[0] == num_rows
    if num_rows == 0:
        return
    # NOTE: the C side bounds-checks every index (token, request, block ids, lengths) before
    # touching memory and returns -2 instead, so a bad call cannot corrupt the process.
    status = kernel.function(
        query.data_ptr(), query.stride(0), query.shape[0],
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], k_cache.shape[1],
        block_table.data_ptr(), block_table.shape[0], block_table.shape[1], block_table.stride(0),
        query_rows.data_ptr(), batch_indices.data_ptr(), seq_lens.data_ptr(), num_rows,
        max_seq_len, scale, int(sliding_window or 0), float(logits_soft_cap or 0.0),
        out.data_ptr(), out.stride(0),
        max(1, min(torch.get_num_threads(), num_rows)),  # one row is one thread's work
    )
    if status == -2:
        raise IndexError("paged attention rows index outside query, block_table or the cache")
    if status != 0:
        raise MemoryError("native paged attention could not allocate its scores buffer")
