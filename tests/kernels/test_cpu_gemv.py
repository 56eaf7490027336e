"""The panel kernels (kernels/cpu_gemv.py, fp32 and bf16): the GEMV of 1-8 rows and the
GEMM of more, against F.linear and against each other (a row's bits do not depend on M)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(cpu_gemv.load_kernel() is None,
                                reason="no C compiler or no AVX-512 here: the GEMV kernel "
                                       "is not built and oneDNN runs every M")


@pytest.mark.parametrize("m", [1, 3, 4, 7, 8, 9, 13, 64, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(m, with_bias):
    # N = 100 is not a multiple of the panel: the last panel is partly padding.
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(100, 40, generator=g)
    bias = torch.randn(100, generator=g) if with_bias else None
    x = torch.randn(m, 40, generator=g)
    out = cpu_gemv.linear(x, cpu_gemv.pack_weight(weight, bias))
    assert out.shape == (m, 100) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_a_row_is_the_same_whatever_the_other_rows():
    g = torch.Generator().manual_seed(0)
    w = cpu_gemv.pack_weight(torch.randn(3072, 576, generator=g), torch.randn(3072, generator=g))
    x = torch.randn(300, 576, generator=g)
    full = cpu_gemv.linear(x, w)  # the GEMM: 50 tiles of 6 rows, blocks of up to 96
    for m in [*range(1, 20), 95, 96, 97, 299]:  # the GEMV (<= 8) and partial GEMM tiles
        assert torch.equal(cpu_gemv.linear(x[:m].clone(), w), full[:m]), m
    assert torch.equal(cpu_gemv.linear(x[5:6].clone(), w)[0], full[5])
    assert torch.equal(cpu_gemv.linear(x[150:299].clone(), w), full[150:299])


@pytest.mark.skipif(cpu_gemv.load_kernel(torch.bfloat16) is None,
                    reason="no AVX512-BF16 here: bf16 weights are refused")
@pytest.mark.parametrize("m", [1, 8, 9, 50])
def test_bf16_panels_sum_in_fp32(m):
    """bf16 x bf16 products summed in fp32 (VDPBF16PS over k pairs): the result is F.linear
    over the same bf16 values in fp32 up to summation order, rounded once to bf16; an fp32
    input is rounded to bf16 first; a row's bits do not depend on M. K = 1100 spans two
    GEMM slices; N = 100 leaves a ragged panel."""
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(100, 1100, generator=g).bfloat16()
    bias = torch.randn(100, generator=g)
    w = cpu_gemv.pack_weight(weight, bias, torch.bfloat16)
    assert w.wpacked.shape == (2, 550, cpu_gemv.PANEL, 2)
    assert torch.equal(cpu_gemv.unpack_weight(w), weight)
    ids = torch.tensor([99, 0, 64, 63])
    assert torch.equal(cpu_gemv.rows(w, ids), weight[ids])
    xb = torch.randn(m, 1100, generator=g).bfloat16()
    outb = cpu_gemv.linear(xb, w)
    assert outb.dtype == torch.bfloat16 and outb.shape == (m, 100)
    exact = F.linear(xb.double(), weight.double(), bias.double())
    # fp32 sums of 1100 terms (|terms| ~ 1), then one bf16 rounding (relative 2^-8)
    torch.testing.assert_close(outb.double(), exact, rtol=2 ** -8, atol=1e-3)
    out32 = cpu_gemv.linear(xb.float(), w)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), exact, rtol=1e-5, atol=1e-3)
    assert torch.equal(outb, out32.bfloat16())  # rounded once
    assert torch.equal(cpu_gemv.linear(xb[-1:].clone(), w), outb[-1:])
    x32 = torch.randn(m, 1100, generator=g)
    assert torch.equal(cpu_gemv.linear(x32, w), cpu_gemv.linear(x32.bfloat16().float(), w))
    with pytest.raises(ValueError, match="K must be even"):
        cpu_gemv.pack_weight(weight[:, :1099], dtype=torch.bfloat16)


def test_gemm_with_k_past_one_slice_and_ragged_panels():
    # K = 700 spans three 256-deep slices (the last partial); N = 130 leaves a ragged panel.
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(130, 700, generator=g), torch.randn(130, generator=g)
    x = torch.randn(37, 700, generator=g)
    out = cpu_gemv.linear(x, cpu_gemv.pack_weight(weight, bias))
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        assert torch.equal(cpu_gemv.linear(x, cpu_gemv.pack_weight(weight, bias)), out)


def test_strided_rows_and_what_it_does_not_take():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 32, generator=g)
    w = cpu_gemv.pack_weight(weight)
    x = torch.randn(3, 64, generator=g)[:, ::2]  # column stride 2: copied to contiguous
    torch.testing.assert_close(cpu_gemv.linear(x, w), x @ weight.T, rtol=1e-5, atol=1e-5)
    rows = torch.randn(6, 48, generator=g)[:, 8:40]  # row stride 48
    torch.testing.assert_close(cpu_gemv.linear(rows[:2], w), rows[:2] @ weight.T,
                               rtol=1e-5, atol=1e-5)
    assert cpu_gemv.linear(torch.randn(0, 32), w).shape == (0, 64)
    assert cpu_gemv.linear(torch.randn(1, 32, dtype=torch.float64), w) is None
    assert torch.equal(cpu_gemv.unpack_weight(w), weight)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_gemv.pack_weight(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_gemv.pack_weight(weight, dtype=torch.float16)
