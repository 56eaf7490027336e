"""The fp32 GEMV kernel for decode steps of 1-8 rows (kernels/cpu_gemv.py) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(cpu_gemv.load_kernel() is None,
                                reason="no C compiler or no AVX-512 here: the GEMV kernel "
                                       "is not built and oneDNN runs every M")


@pytest.mark.parametrize("m", [1, 3, 4, 7, 8])
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
    w = cpu_gemv.pack_weight(torch.randn(3072, 576, generator=g))
    x = torch.randn(cpu_gemv.MAX_ROWS, 576, generator=g)
    full = cpu_gemv.linear(x, w)
    for m in range(1, cpu_gemv.MAX_ROWS):
        assert torch.equal(cpu_gemv.linear(x[:m].clone(), w), full[:m])
    assert torch.equal(cpu_gemv.linear(x[5:6].clone(), w)[0], full[5])


def test_strided_rows_and_what_it_does_not_take():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 32, generator=g)
    w = cpu_gemv.pack_weight(weight)
    x = torch.randn(3, 64, generator=g)[:, ::2]  # column stride 2: copied to contiguous
    torch.testing.assert_close(cpu_gemv.linear(x, w), x @ weight.T, rtol=1e-5, atol=1e-5)
    rows = torch.randn(6, 48, generator=g)[:, 8:40]  # row stride 48
    torch.testing.assert_close(cpu_gemv.linear(rows[:2], w), rows[:2] @ weight.T,
                               rtol=1e-5, atol=1e-5)
    assert cpu_gemv.linear(torch.randn(cpu_gemv.MAX_ROWS + 1, 32), w) is None  # oneDNN's
    assert cpu_gemv.linear(torch.randn(0, 32), w) is None
    assert cpu_gemv.linear(torch.randn(1, 32, dtype=torch.float64), w) is None
    assert torch.equal(cpu_gemv.unpack_weight(w), weight)
    with pytest.raises(ValueError, match="float32"):
        cpu_gemv.pack_weight(torch.randn(4, 4, dtype=torch.bfloat16))
