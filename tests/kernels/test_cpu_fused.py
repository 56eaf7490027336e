"""The fused CPU ops (`kernels/cpu_fused.py`) against the plain torch ops they replace.

On x86 CPUs that torch runs with AVX2 / AVX-512 kernels the fused ops are bit-identical to
torch's; elsewhere they must agree to within a few ulp.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_fused

IS_EXACT = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def num_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.fixture(params=["native", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        if cpu_fused.load_fused_kernels() is None:
            pytest.skip("no C compiler: the fused kernels were not built")
    else:
        monkeypatch.setattr(cpu_fused, "load_fused_kernels", lambda: None)
    return request.param


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if IS_EXACT:
        mismatched = (out != ref).sum().item()
        assert mismatched == 0, f"{mismatched} elements differ, max {(out - ref).abs().max()}"
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_tables(max_positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("num_tokens,d", [(1, 1), (3, 7), (5, 33), (64, 1536), (7, 1537),
                                          (2, 16), (4, 63)])
def test_silu_and_mul_matches_torch(num_tokens, d, num_threads, backend):
    torch.manual_seed(d)
    # Row stride 2 * d + 3: the input is a column slice of a wider tensor.
    wide = torch.randn(num_tokens, 2 * d + 3) * 6
    gate_up = wide[:, : 2 * d]
    out = cpu_fused.silu_and_mul(gate_up)
    gate, up = gate_up.split(d, dim=-1)
    assert out.is_contiguous()
    assert_matches(out, F.silu(gate) * up)


def test_silu_and_mul_extremes(backend):
    gate = torch.tensor([[0.0, -0.0, 1.0, -1.0, 88.0, -88.0, 103.0, -105.0, 1e-30, -1e-30,
                          float("inf"), float("-inf"), float("nan"), 30.0, -30.0, 2.5] * 2])
    out = cpu_fused.silu_and_mul(torch.cat((gate, torch.full_like(gate, 2.0)), dim=1))
    assert out[0, 0].item() == 0.0
    assert out[0, 2].item() == pytest.approx(2 / (1 + torch.e ** -1), rel=1e-6)
    assert out[0, 10].item() == float("inf") and torch.isnan(out[0, 12])
    tolerance = 0.0 if IS_EXACT else 1e-6
    torch.testing.assert_close(out, F.silu(gate) * 2.0, rtol=tolerance, atol=tolerance,
                               equal_nan=True)


@pytest.mark.parametrize("num_tokens,hidden", [(1, 1), (3, 7), (2, 15), (5, 16), (4, 17),
                                               (64, 576), (3, 1000), (2, 4096), (1, 20000)])
def test_rms_norm_matches_torch(num_tokens, hidden, num_threads, backend):
    torch.manual_seed(hidden)
    wide = torch.randn(num_tokens, hidden + 5) * 3
    x = wide[:, :hidden]  # row stride hidden + 5
    weight = torch.randn(hidden)
    before = x.clone()
    out = cpu_fused.rms_norm(x, weight, 1e-5)
    assert torch.equal(x, before), "rms_norm does not write its input"
    assert out.is_contiguous()
    assert_matches(out, rms_norm_reference(x, weight, 1e-5))


@pytest.mark.parametrize("num_tokens,hidden", [(1, 7), (6, 17), (64, 576), (2, 4096)])
def test_fused_add_rms_norm_in_place(num_tokens, hidden, num_threads, backend):
    torch.manual_seed(hidden)
    x = torch.randn(num_tokens, hidden) * 2
    residual = torch.randn(num_tokens, hidden)
    weight = torch.randn(hidden)
    expected_residual = residual + x
    expected_x = rms_norm_reference(expected_residual, weight, 1e-6)
    cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert_matches(x, expected_x)


@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim",
                         [(1, 9, 3, 64), (37, 9, 3, 64), (5, 4, 4, 6), (3, 2, 1, 2),
                          (300, 8, 2, 128)])
def test_rotary_embedding_on_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim,
                                       num_threads, backend):
    torch.manual_seed(num_tokens)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size)
    original = qkv.clone()
    cos, sin = rope_tables(512, head_dim)
    positions = torch.randint(0, 512, (num_tokens,))
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    cpu_fused.rotary_embedding(q, k, positions, cos, sin)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q_ref = rotate_reference(original[:, :q_size].view_as(q), c, s)
    k_ref = rotate_reference(original[:, q_size:q_size + kv_size].view_as(k), c, s)
    assert_matches(q, q_ref)
    assert_matches(k, k_ref)
    assert torch.equal(qkv[:, q_size + kv_size:], original[:, q_size + kv_size:]), "v untouched"


def test_rotary_embedding_position_zero_is_identity(backend):
    cos, sin = rope_tables(4, 8)
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    q0, k0 = q.clone(), k.clone()
    cpu_fused.rotary_embedding(q, k, torch.tensor([0]), cos, sin)
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("bad_position", [-1, 16])
def test_rotary_embedding_rejects_positions_outside_the_table(bad_position, backend):
    cos, sin = rope_tables(16, 8)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(IndexError):
        cpu_fused.rotary_embedding(q, k, torch.tensor([1, bad_position, 2]), cos, sin)
    assert torch.equal(q, q0) and torch.equal(k, k0), "a rejected call writes nothing"


def test_wrappers_reject_bad_layouts():
    x = torch.randn(4, 8)
    with pytest.raises(AssertionError):
        cpu_fused.rms_norm(x.t(), torch.ones(4), 1e-6)  # columns not contiguous
    with pytest.raises(AssertionError):
        cpu_fused.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(AssertionError):
        cpu_fused.silu_and_mul(torch.randn(2, 7))  # odd width
    with pytest.raises(AssertionError):
        cpu_fused.fused_add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-6)
    q = torch.randn(2, 8, 3).transpose(1, 2)  # [2, 3, 8] with heads not contiguous
    cos, sin = rope_tables(4, 8)
    with pytest.raises(AssertionError):
        cpu_fused.rotary_embedding(q, torch.randn(2, 1, 8), torch.tensor([0, 1]), cos, sin)


def test_without_a_compiler_nothing_is_built(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cpu_fused, "_find_compiler", lambda: None)
    assert cpu_fused.load_fused_kernels.__wrapped__() is None


def test_env_switch(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PDSERVE_FUSED_CPU", raising=False)
    assert cpu_fused.is_enabled()
    monkeypatch.setenv("PDSERVE_FUSED_CPU", "0")
    assert not cpu_fused.is_enabled()


def test_loading_the_fused_kernels_keeps_denormals():
    """The library must not switch the process to flush-to-zero / denormals-are-zero."""
    code = (
        "import torch\n"
        "from pdserve.kernels.cpu_fused import load_fused_kernels\n"
        "k = load_fused_kernels()\n"
        "t = torch.tensor([1e-40], dtype=torch.float32)\n"
        "print(k is not None, float('1e-310') * 1.5 > 0, float(t * 1.5) > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    if out[0] != "True":
        pytest.skip("no C compiler: the kernels were not built")
    assert out[1:] == ["True", "True"], out


def test_threads_for_gives_small_inputs_one_thread():
    """One thread per row at most, MIN_ELEMENTS_PER_THREAD elements each, torch's count
    at most: a single stream's decode step never forks a team it cannot use."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    assert cpu_fused.threads_for(1, 576) == 1
    assert cpu_fused.threads_for(1, 10**6) == 1
    assert cpu_fused.threads_for(4, 576) == 1
    assert cpu_fused.threads_for(64, 2 * 576) == 2
    assert cpu_fused.threads_for(2048, 576) == 2
    torch.set_num_threads(1)
    try:
        assert cpu_fused.threads_for(2048, 576) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("num_tokens,hidden", [(1, 7), (5, 64), (64, 576), (3, 1537)])
def test_bf16_ops_match_torchs_bf16_ops(num_tokens, hidden, backend):
    """--dtype bfloat16: each fused op gives the bits of the torch bf16 ops the model runs
    without it (one bf16 rounding per torch op), strided rows included."""
    torch.manual_seed(hidden)
    wide = (torch.randn(num_tokens, 2 * hidden + 3) * 4).bfloat16()
    gate_up = wide[:, :2 * hidden]
    gate, up = gate_up.split(hidden, dim=-1)
    assert_matches(cpu_fused.silu_and_mul(gate_up), F.silu(gate) * up)

    x, weight = wide[:, :hidden], torch.randn(hidden).bfloat16()
    x32 = x.float()
    ref = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert_matches(cpu_fused.rms_norm(x, weight, 1e-5), ref)
    h, residual = x.clone(), torch.randn(num_tokens, hidden).bfloat16()
    expected_residual = residual + h
    r32 = expected_residual.float()
    expected = weight * (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    cpu_fused.fused_add_rms_norm(h, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    assert_matches(h, expected)

    cos, sin = (t.bfloat16() for t in rope_tables(512, 64))
    qkv = torch.randn(num_tokens, 5 * 64).bfloat16()
    original = qkv.clone()
    q, k = qkv[:, :192].view(num_tokens, 3, 64), qkv[:, 192:256].view(num_tokens, 1, 64)
    positions = torch.randint(0, 512, (num_tokens,))
    cpu_fused.rotary_embedding(q, k, positions, cos, sin)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    assert_matches(q, rotate_reference(original[:, :192].view_as(q), c, s))
    assert_matches(k, rotate_reference(original[:, 192:256].view_as(k), c, s))
    assert torch.equal(qkv[:, 256:], original[:, 256:])
