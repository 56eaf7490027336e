"""kernels/cpu_int8_vnni: the W8A8 kernel (activations int8 per row and block of k, vpdpbusd)
against the same block quantization done in torch (float64 sums), tile tails and row blocks,
odd shapes, rows independent of the batch, NaN / inf propagated, the packed layout, 16-bit
activations (`a16`), and `cpu_int8.linear`'s dispatch (w8a8 / a16 layers only; K not a
multiple of the block or no VNNI: weight-only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_int8
from pdserve.kernels import cpu_int8_vnni as vnni

CPUINFO = Path("/proc/cpuinfo")
HAS_VNNI = CPUINFO.exists() and "avx512_vnni" in CPUINFO.read_text()
needs_kernel = pytest.mark.skipif(vnni.load_kernel() is None, reason="no AVX-512 VNNI kernel")


def reference(x: torch.Tensor, w8: cpu_int8.Int8Weight, block: int, act_bits: int = 8
              ) -> torch.Tensor:
    """The kernel's arithmetic in torch: block int dots (exact in float64), scaled."""
    q, d = vnni.quantize_activations(x, block, act_bits)
    n, (m, k) = w8.out_features, x.shape
    qw = w8.int_weight().double()
    dots = torch.einsum("mbk,nbk->mnb", q.double().view(m, k // block, block),
                        qw.view(n, k // block, block))
    return (dots * d.double()[:, None, :]).sum(2) * w8.scale[:n].double() + w8.bias[:n]


def _layer(n, k, bias, seed, w8a8=True):
    g = torch.Generator().manual_seed(seed)
    return cpu_int8.quantize_linear(torch.randn(n, k, generator=g) * 0.05,
                                    torch.randn(n, generator=g) if bias else None, w8a8), g


def test_quantize_activations_is_symmetric_per_block():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2.54, 1.0, 32)
    x[1, 40] = 0.5
    q, d = vnni.quantize_activations(x, 32)
    assert q.dtype == torch.int8 and d.shape == (2, 2)
    assert d.flatten().tolist() == pytest.approx([2.54 / 127, 0.0, 0.0, 0.5 / 127])
    assert q[0, 0] == -127 and q[1, 40] == 127 and q[0, 32:].eq(0).all()
    err = (x.view(2, 2, 32) - q.float().view(2, 2, 32) * d[:, :, None]).abs()
    assert err.le(d[:, :, None] / 2 + 1e-7).all()


def test_the_kernel_is_built_where_the_cpu_has_vnni():
    if HAS_VNNI:
        assert vnni.load_kernel() is not None


@needs_kernel
@pytest.mark.parametrize("m, n, k, block, bias", [
    (1, 40, 64, 32, True),        # one row; a panel tail of 8
    (7, 7, 32, 32, True),         # N < 16: one masked half; tiles of 6 + 1
    (16, 960, 576, 32, False),
    (17, 576, 576, 32, True),     # tiles of 6 + a tail of 5
    (67, 576, 1536, 32, False),   # a tail of 1
    (200, 70, 576, 32, True),     # three row blocks (96 rows), the last of 8
    (11, 50, 1536, 64, True),     # block 64
    (20, 33, 64, 16, True)])      # block 16
def test_kernel_matches_the_block_quantized_reference(m, n, k, block, bias):
    w8, g = _layer(n, k, bias, m * 1000 + n + k)
    x = torch.randn(m, k, generator=g) * 3
    x[m // 2, :block] = 0  # an all-zero block: scale 0
    got = vnni.linear(x, w8, block)
    ref = reference(x, w8, block)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # int dots are exact; only the fp32 scaling rounds (one activation step off would be 1e-3)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max())
    # and close to the fp32 product of the weight-only int8 layer
    assert (got - F.linear(x, w8.dequantize(), w8.bias[:n])).abs().max() < 0.05 * ref.abs().max()


@needs_kernel
def test_rows_do_not_depend_on_the_batch():
    w8, g = _layer(96, 576, True, 0)
    x = torch.randn(64, 576, generator=g)
    x[7] *= 50  # an outlier row must not change the others
    full = cpu_int8.linear(x, w8)
    # rows land in other tiles (6 rows) and row blocks (96 rows): the same arithmetic
    for rows in ([0], [5, 6], list(range(3, 9)), list(range(9, 33)), [7, 1, 60, 2, 30]):
        assert torch.equal(cpu_int8.linear(x[rows], w8), full[rows]), rows
    big = torch.cat([torch.randn(150, 576, generator=g), x])  # x's rows in row blocks 2-3
    assert torch.equal(cpu_int8.linear(big, w8)[150:], full)
    strided = torch.randn(8, 1152, generator=g)[:, ::2]  # column stride 2
    assert torch.equal(cpu_int8.linear(strided, w8), cpu_int8.linear(strided.contiguous(), w8))


@needs_kernel
def test_dispatch_by_rows_and_shape(monkeypatch):
    w8, g = _layer(40, 64, True, 1)
    x = torch.randn(8, 64, generator=g)
    assert torch.equal(cpu_int8.linear(x[:1], w8), vnni.linear(x[:1], w8))
    weight_only = F.linear(x, w8.dequantize(), w8.bias[:40])
    assert (cpu_int8.linear(x, w8) - weight_only).abs().max() > 1e-4  # activations quantized
    # a layer without w8a8 (the default) stays weight-only
    assert not cpu_int8.quantize_linear(torch.ones(2, 16)).w8a8
    torch.testing.assert_close(cpu_int8.linear(x, w8._replace(w8a8=False)), weight_only)
    assert cpu_int8.linear(x.double(), w8).dtype == torch.float32  # no kernel: dequantized
    # K not a multiple of the block: refused here, weight-only in cpu_int8.linear
    w48, g = _layer(9, 48, False, 2)
    x48 = torch.randn(7, 48, generator=g)
    assert w48.qpacked.dim() == 3  # kept in the weight-only layout
    assert vnni.linear(x48, w48) is None and vnni.linear(x, w8, block=24) is None
    torch.testing.assert_close(cpu_int8.linear(x48, w48), F.linear(x48, w48.dequantize()))
    assert cpu_int8.linear(torch.empty(0, 64), w8).shape == (0, 40)


def test_without_vnni_it_stays_weight_only(monkeypatch):
    monkeypatch.setattr(vnni, "load_kernel", lambda: None)
    w8, g = _layer(20, 32, True, 3)
    assert w8.qpacked.shape == (1, 32, 32) and w8.qpacked.dtype == torch.int8
    x = torch.randn(9, 32, generator=g)
    assert vnni.linear(x, w8) is None
    torch.testing.assert_close(cpu_int8.linear(x, w8),
                               F.linear(x, w8.dequantize(), w8.bias[:20]))


@needs_kernel
def test_weights_are_packed_once_in_the_tile_layout():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(5))
    w8, q = cpu_int8.quantize_linear(w, w8a8=True), cpu_int8.quantize_linear(w).qpacked
    assert w8.qpacked.shape == (2, 16, 32, 4) and w8.qpacked.dtype == torch.uint8
    # wv[p, k // 4, c, k % 4] = q[32p + c, k] + 128
    assert w8.qpacked[1, 2, 3, 1].item() == q[1, 9, 3].item() + 128
    assert torch.equal(vnni.unpack_weight(w8.qpacked), q)
    assert torch.equal(w8.panels(), q)
    ids = torch.tensor([0, 39, 33, 0])
    assert torch.equal(cpu_int8.embedding(ids, w8), w8.dequantize()[ids])


@needs_kernel
def test_nan_and_inf_come_out_non_finite():
    w8, g = _layer(70, 128, True, 6)
    x = torch.randn(9, 128, generator=g)
    x[1, 5] = float("nan")
    x[3, 40] = float("inf")
    x[4, 100] = float("-inf")
    x[5, 64:96] = 1e-39  # below FLT_MIN: a zero block, finite
    x[6, 7], x[6, 70] = float("inf"), float("nan")
    got = cpu_int8.linear(x, w8)
    ref = F.linear(x, w8.dequantize(), w8.bias[:70])
    assert got[1].isnan().all() and got[6].isnan().all()
    for row in (3, 4):  # +-inf where fp32 has it, with its sign
        assert torch.equal(got[row].isinf(), ref[row].isinf()), row
        assert torch.equal(got[row].sign(), ref[row].sign()), row
    finite = [0, 2, 5, 7, 8]
    assert got[finite].isfinite().all()
    torch.testing.assert_close(got[finite], vnni.linear(x[finite], w8))
    q, d = vnni.quantize_activations(x)
    assert d[1, 0].isnan() and d[3, 1].isinf() and q[3, 40] == 127 and q[4, 100] == -127
    assert d[5, 2] == 0 and q[5, 64:96].eq(0).all()


@needs_kernel
@pytest.mark.parametrize("m, n, k, bias", [
    (1, 40, 64, True), (7, 70, 576, False),  # tiles of 4 + 3
    (101, 33, 1536, True)])                  # two row blocks, a tail of 1
def test_16_bit_activations_match_their_reference(m, n, k, bias):
    w8, g = _layer(n, k, bias, m + n + k, w8a8=False)
    w16 = cpu_int8.quantize_linear(w8.dequantize(), w8.bias[:n] if bias else None, a16=True)
    assert w16.a16 and not w16.w8a8 and w16.qpacked.dim() == 4
    assert torch.equal(w16.int_weight(), w8.int_weight())
    x = torch.randn(m, k, generator=g) * 3
    x[0, :5] *= 1000  # an outlier block
    got = cpu_int8.linear(x, w16)
    ref = reference(x, w16, 32, act_bits=16)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max())
    # 16 bits: within 1e-4 of the weight-only (fp32 activations) product
    weight_only = cpu_int8.linear(x, w8)
    assert (got - weight_only).abs().max() < 1e-4 * weight_only.abs().max()
    for rows in ([0], list(range(1, m)), [m - 1, 0]):
        assert torch.equal(cpu_int8.linear(x[rows], w16), got[rows]), rows
    x[-1, 3] = float("nan")
    x[0, 9] = float("-inf")
    got = cpu_int8.linear(x, w16)
    assert got[-1].isnan().all() and not got[0].isfinite().any()
