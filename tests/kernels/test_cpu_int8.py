"""kernels/cpu_int8: symmetric per-channel quantization, the panel packing, and the weight-only
int8 linear (C kernel, both its paths: <= 4 rows and more) against the dequantized weight
through F.linear; rows independent of the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_int8


def _dequant(w8: cpu_int8.Int8Weight) -> torch.Tensor:
    return w8.dequantize()


def test_quantize_weight_is_symmetric_per_row():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [2.54, 0.02, -1.27]])
    q, s = cpu_int8.quantize_weight(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert s.tolist() == pytest.approx([1.0 / 127, 1.0, 2.54 / 127])
    assert q[0].tolist() == [64, -127, 32]  # round(63.5) -> 64 (half to even: 64)
    assert q[1].tolist() == [0, 0, 0]
    assert q[2].tolist() == [127, 1, -64]  # -63.5 -> -64
    assert int(q.abs().max()) <= 127
    # the error per element is at most half a step
    assert (w - q.float() * s[:, None]).abs().le(s[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("m, n, k, bias", [
    (1, 8, 16, False), (3, 12, 32, True), (4, 64, 576, False), (5, 36, 64, True),
    (17, 960, 576, True), (64, 576, 1536, False), (2, 7, 48, True)])  # n=7: a tail of 3
def test_linear_matches_dequantized_f_linear(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    w8 = cpu_int8.quantize_linear(w, b)
    got = cpu_int8.linear(x, w8)
    ref = F.linear(x, _dequant(w8), b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_c_kernel_is_built_here():
    assert cpu_int8.load_kernel() is not None


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    w8 = cpu_int8.quantize_linear(torch.randn(96, 576, generator=g) * 0.05)
    x = torch.randn(64, 576, generator=g)
    x[7] *= 50  # an outlier row must not change the others
    full = cpu_int8.linear(x, w8)
    for rows in ([0], [0, 1, 2], list(range(5)), list(range(9, 20))):
        assert torch.equal(cpu_int8.linear(x[rows], w8), full[rows]), rows


def test_non_contiguous_rows_and_an_empty_batch():
    g = torch.Generator().manual_seed(1)
    w8 = cpu_int8.quantize_linear(torch.randn(16, 32, generator=g))
    x = torch.randn(6, 64, generator=g)[:, ::2]  # column stride 2
    torch.testing.assert_close(cpu_int8.linear(x, w8), F.linear(x, _dequant(w8)),
                               rtol=1e-5, atol=1e-5)
    assert cpu_int8.linear(torch.empty(0, 32), w8).shape == (0, 16)


def test_packing_round_trips_and_pads_to_whole_panels():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 24, generator=g)
    q, s = cpu_int8.quantize_weight(w)
    w8 = cpu_int8.quantize_linear(w, torch.arange(40.0))
    assert w8.qpacked.shape == (2, 24, 32) and w8.out_features == 40
    assert torch.equal(w8.qpacked[1, :, 3], q[35])  # panel 1, channel 3 = row 35
    assert torch.equal(w8.qpacked[1, :, 8:], torch.zeros(24, 24, dtype=torch.int8))
    assert torch.equal(w8.dequantize(), q.float() * s[:, None])
    assert w8.bias[:40].tolist() == list(range(40)) and w8.bias[40:].eq(0).all()


def test_without_the_c_kernel_it_dequantizes(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w8 = cpu_int8.quantize_linear(torch.randn(8, 20, generator=g), torch.ones(8))
    x = torch.randn(3, 20, generator=g)
    expected = cpu_int8.linear(x, w8)
    monkeypatch.setattr(cpu_int8, "load_kernel", lambda: None)
    got = cpu_int8.linear(x, w8)
    torch.testing.assert_close(got, F.linear(x, _dequant(w8), torch.ones(8)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_embedding_rows_are_dequantized():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(50, 16, generator=g)
    q, s = cpu_int8.quantize_weight(w)
    ids = torch.tensor([3, 0, 49, 3, 32])
    got = cpu_int8.embedding(ids, cpu_int8.quantize_linear(w))
    assert torch.equal(got, (q.float() * s[:, None])[ids])
