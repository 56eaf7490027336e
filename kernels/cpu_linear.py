"""Prepacked fp32 linear layers on CPU through oneDNN (torch's `mkldnn` ops).

`torch.nn.functional.linear` on CPU calls a generic sgemm that re-reads the row-major weight
in its own blocking on every call; for the small-M GEMMs of decode steps (M = batch size)
that costs 2-2.5x the time of a GEMM whose weight was reordered once, at load time, into the
blocked layout oneDNN's JIT kernels read (measured on this project's 2-core AVX-512 machines:
one layer's four matmuls plus the LM head at M=64, 47.7 ms -> 20.7 ms; at M=2048 without the
LM head, 97.8 -> 68.1 ms). Source: oneDNN's "weights prepacking" (the reorder to a
`format_tag::any` matmul descriptor), used for CPU linear layers by PyTorch Inductor's
freezing pass (`mkldnn._linear_pointwise`) and by vLLM's CPU backend (`onednn_mm`).

Results differ from `F.linear` by fp32 rounding only (relative 1e-6: another summation
order); a row's result does not depend on the other rows of the batch for M <= 130 at
least (it may at prefill sizes, as with any blocked GEMM).

    packed = pack_weight(layer.weight)        # once, after loading
    y = linear(x, packed, layer.bias)         # x [M, K] fp32 -> [M, N]

Set PDSERVE_PACKED_LINEAR=0 to keep `F.linear`.
"""

from __future__ import annotations

import functools
import os
import threading

import torch


def is_enabled() -> bool:
    """PDSERVE_PACKED_LINEAR is not "0" (the switch for comparisons and debugging)."""
    return os.environ.get("PDSERVE_PACKED_LINEAR", "1") != "0"


@functools.cache
def is_available() -> bool:
    """This torch build has oneDNN and its prepacked linear ops (x86 CPU builds do)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        x = torch.randn(3, 4)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(out, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-6))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 CPU -> an opaque oneDNN tensor for `linear` (a copy: N*K*4 bytes).

    Raises:
        ValueError: not a 2-D fp32 CPU tensor.
    """
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_weight needs a 2-D float32 CPU weight, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


MIN_ROWS = 4
"""Fewer rows than this run as MIN_ROWS rows (zero padding; the extra rows are dropped)."""


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [M, K] float32 -> x @ W.T + bias, [M, N] float32, W packed by `pack_weight`.

    NOTE: oneDNN picks its kernel by M; for M < 4 (a decode step of 1-3 streams) its choice
    reads the packed weights slower than the M = 4 kernel does (on the 2-core AVX-512 test
    machine, the 30 layers' matmuls plus the LM head took 28 ms at M = 1 and 31 at M = 2
    against 25 at M = 4), so such inputs are padded to MIN_ROWS rows. A row's result then
    does not depend on whether 1, 2, 3 or 4 rows ran.
    """
    m = x.shape[0]
    if 0 < m < MIN_ROWS:
        padded = _padding_buffer(x)
        padded[:m] = x
        return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_buffers = threading.local()


def _padding_buffer(x: torch.Tensor) -> torch.Tensor:
    """A [MIN_ROWS, K] buffer of x's dtype kept per thread and per K.

    NOTE: a fresh zeroed tensor per call cost 3 more dispatcher ops per linear (121 linears
    a step); the rows past m may hold an earlier call's rows, which is harmless: each
    output row depends only on its own input row.
    """
    cache = getattr(_buffers, "cache", None)
    if cache is None:
        cache = _buffers.cache = {}
    # NOTE: a buffer made under torch.inference_mode is an inference tensor, which may not
    # be written outside it (an offline LLM and a test in one thread): one buffer per mode.
    key = (x.shape[1], x.dtype, x.device, torch.is_inference_mode_enabled())
    buf = cache.get(key)
    if buf is None:
        buf = cache[key] = x.new_zeros((MIN_ROWS, x.shape[1]))
    return buf
