"""The fast CPU path (`kernels/torch_paged.py`, native kernel and torch-ops fallback) against
the reference, on ragged mixed batches with shuffled block tables."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import ops, reference, torch_paged
from pdserve.kernels.cpu_native import DecodeRows, load_native_kernel, paged_attention_rows
from tests.kernels.batch_utils import PagedBatch, make_paged_batch, random_mixed_lens

REPO_ROOT = Path(__file__).resolve().parents[2]


def attention_args(batch: PagedBatch, scale: float) -> tuple:
    return (batch.query, batch.k_cache, batch.v_cache, batch.attn_metadata, scale)


def assert_matches_reference(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert not out.isnan().any()
    relative_error = float((out - expected).norm() / expected.norm())
    assert relative_error < 2e-6, relative_error
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def native_available(head_dim: int, num_kv_heads: int, group_size: int) -> bool:
    return load_native_kernel(head_dim, num_kv_heads, group_size) is not None


CONFIGS = [  # num_heads, num_kv_heads, head_dim, block_size
    (9, 3, 64, 16),  # SmolLM2-135M
    (4, 2, 16, 8),
    (8, 1, 32, 32),  # one kv head (MQA)
    (4, 4, 16, 16),  # no GQA
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), CONFIGS)
@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, use_native: bool,
    seed: int,
) -> None:
    seq_lens, query_lens = random_mixed_lens(
        24, 4, max_seq_len=200, max_query_len=40, seed=seed)
    batch = make_paged_batch(
        seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, num_pad_tokens=2, seed=seed)
    args = attention_args(batch, head_dim**-0.5)
    out = torch_paged.paged_attention(*args, use_native=use_native)
    assert_matches_reference(out, reference.paged_attention(*args))


@pytest.mark.parametrize("use_native", [True, False])
def test_metadata_is_reused_across_layers(use_native: bool) -> None:
    seq_lens, query_lens = random_mixed_lens(16, 3, max_seq_len=120, max_query_len=30, seed=5)
    layers = [make_paged_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=32,
                               seed=5, data_seed=data_seed) for data_seed in (5, 6, 7)]
    for layer in layers[1:]:  # one block table, different caches and queries per layer
        assert torch.equal(layer.block_table, layers[0].block_table)
        assert not torch.equal(layer.query, layers[0].query)
    first = layers[0]
    metadata = ops.prepare_torch_metadata(first.attn_metadata, block_size=16, num_kv_heads=2)
    for layer in layers:
        args = attention_args(layer, 0.2)
        out = torch_paged.paged_attention(*args, torch_metadata=metadata, use_native=use_native)
        assert_matches_reference(out, reference.paged_attention(*args))


@pytest.mark.parametrize("use_native", [True, False])
def test_decode_only_batch_and_strided_query(use_native: bool) -> None:
    """Decodes of length 1 and exactly one block, and a query that is a view into a fused
    qkv projection (non-contiguous rows), as the model produces it."""
    seq_lens = [1, 16, 17, 33, 250, 5, 64]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_heads=9, num_kv_heads=3,
                             head_dim=64)
    qkv = torch.randn(len(seq_lens), (9 + 2 * 3) * 64)
    qkv[:, : 9 * 64] = batch.query.reshape(len(seq_lens), -1)
    query = qkv[:, : 9 * 64].view(len(seq_lens), 9, 64)
    args = attention_args(batch._replace(query=query), 0.125)
    out = torch_paged.paged_attention(*args, use_native=use_native)
    assert_matches_reference(out, reference.paged_attention(*args))


def test_prefill_only_batch_through_the_package() -> None:
    seq_lens, query_lens = [40, 70, 33], [40, 20, 7]  # fresh prefill and two chunked ones
    batch = make_paged_batch(seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_dim=16)
    args = attention_args(batch, 0.25)
    out = ops.paged_attention(*args, backend="torch")
    assert_matches_reference(out, ops.paged_attention(*args, backend="reference"))


def test_native_kernel_rows_cover_chunked_prefill() -> None:
    """The C kernel's per-row seq_lens also express chunked prefill rows."""
    if not native_available(32, 2, 3):
        pytest.skip("no C compiler with OpenMP here")
    seq_lens, query_lens = random_mixed_lens(8, 4, max_seq_len=100, max_query_len=30, seed=3)
    batch = make_paged_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=32)
    query_rows, batch_indices, row_seq_lens = [], [], []
    starts = batch.query_start_loc.tolist()
    for req_idx, seq_len in enumerate(seq_lens):
        q_len = starts[req_idx + 1] - starts[req_idx]
        for row in range(q_len):
            query_rows.append(starts[req_idx] + row)
            batch_indices.append(req_idx)
            row_seq_lens.append(seq_len - q_len + row + 1)
    out = torch.zeros_like(batch.query)
    kernel = load_native_kernel(32, 2, 3)
    assert kernel is not None
    rows = DecodeRows(torch.tensor(query_rows), torch.tensor(batch_indices),
                      torch.tensor(row_seq_lens, dtype=torch.int32), max(row_seq_lens))
    paged_attention_rows(kernel, batch.query, batch.k_cache, batch.v_cache, batch.block_table,
                         rows, 0.3, out)
    assert_matches_reference(out, reference.paged_attention(*attention_args(batch, 0.3)))


@pytest.mark.parametrize("backend,has_skips", [("torch", None), ("torch", True),
                                               ("reference", None)])
def test_store_kv_cache_skips_padding(backend: ops.Backend, has_skips: bool | None
                                      ) -> None:
    seq_lens, query_lens = random_mixed_lens(5, 2, max_seq_len=50, max_query_len=12, seed=9)
    batch = make_paged_batch(seq_lens, query_lens, num_kv_heads=2, head_dim=16,
                             num_pad_tokens=3)
    num_tokens = batch.slot_mapping.shape[0]
    key = torch.randn(num_tokens, 2, 16)
    value = torch.randn(num_tokens, 2, 16)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    ops.store_kv_cache(key, value, k_cache, v_cache, batch.slot_mapping, backend=backend,
                           has_skips=has_skips)
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    for token_idx, slot in enumerate(batch.slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot // 16, slot % 16] = key[token_idx]
            expected_v[slot // 16, slot % 16] = value[token_idx]
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)


def test_import_is_ours_and_needs_no_triton() -> None:
    code = ("import sys; from pdserve.kernels import ops; print(ops.__file__); "
            "print('triton' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True)
    package_file, triton_loaded = result.stdout.split()
    assert Path(package_file).resolve().is_relative_to(REPO_ROOT)
    assert triton_loaded == "False"


def test_native_kernel_rejects_out_of_bounds_indices() -> None:
    if not native_available(16, 2, 2):
        pytest.skip("no C compiler with OpenMP here")
    kernel = load_native_kernel(16, 2, 2)
    assert kernel is not None
    batch = make_paged_batch([20, 9], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16)
    out = torch.zeros_like(batch.query)
    query_rows, batch_indices = torch.tensor([0, 1]), torch.tensor([0, 1])
    bad_table = batch.block_table.clone()
    bad_table[0, 1] = batch.k_cache.shape[0]  # one past the last block
    cases = [  # (block_table, seq_lens, max_seq_len)
        (bad_table, [20, 9], 20),
        (batch.block_table, [20, 9], 19),  # a length over the declared max
        (batch.block_table, [20, 0], 20),  # an empty row
        (batch.block_table, [40, 9], 40),  # more blocks than the table row holds
    ]
    for block_table, seq_lens, max_seq_len in cases:
        rows = DecodeRows(query_rows, batch_indices, torch.tensor(seq_lens, dtype=torch.int32),
                          max_seq_len)
        with pytest.raises(IndexError):
            paged_attention_rows(kernel, batch.query, batch.k_cache, batch.v_cache, block_table,
                                 rows, 0.25, out)
    assert torch.all(out == 0), "a rejected call writes nothing"


def test_without_a_compiler_the_torch_ops_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "_find_compiler", lambda: None)
    assert cpu_native.load_native_kernel.__wrapped__(64, 3, 3) is None
    monkeypatch.setattr(torch_paged, "load_native_kernel", lambda *shape: None)
    seq_lens, query_lens = random_mixed_lens(10, 2, max_seq_len=100, max_query_len=20, seed=8)
    batch = make_paged_batch(seq_lens, query_lens, num_heads=9, num_kv_heads=3, head_dim=64)
    args = attention_args(batch, 0.125)
    assert_matches_reference(torch_paged.paged_attention(*args), reference.paged_attention(*args))


def test_loading_the_c_kernel_keeps_denormals():
    """Loading the compiled kernel must not switch the process to flush-to-zero /
    denormals-are-zero (gcc's crtfastmath.o does that when -ffast-math reaches the link)."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from pdserve.kernels.cpu_native import load_native_kernel\n"
        "k = load_native_kernel(32, 2, 3)\n"
        "tiny = float('1e-310')\n"
        "t = torch.tensor([1e-40], dtype=torch.float32)\n"
        "print(k is not None, tiny * 1.5 > 0, float(t * 1.5) > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    if out[0] != "True":
        pytest.skip("no C compiler: the kernel was not built")
    assert out[1:] == ["True", "True"], out


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), CONFIGS[:2])
def test_bf16_cache_decodes_in_fp32(num_heads, num_kv_heads, head_dim, block_size) -> None:
    """A bf16 batch (query and cache, as a `--dtype bfloat16` model holds them): the native
    kernel's decode rows equal the reference run in fp32 over the same bf16 values, rounded
    to bf16 once; the prefill rows (torch ops in bf16) stay within bf16's rounding, and
    equal the reference too when they run as kernel rows."""
    if load_native_kernel(head_dim, num_kv_heads, num_heads // num_kv_heads,
                          torch.bfloat16) is None:
        pytest.skip("no C compiler with OpenMP here")
    seq_lens, query_lens = random_mixed_lens(16, 3, max_seq_len=150, max_query_len=20, seed=4)
    batch = make_paged_batch(seq_lens, query_lens, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim,
                             block_size=block_size, seed=4)
    b16 = batch._replace(query=batch.query.bfloat16(), k_cache=batch.k_cache.bfloat16(),
                         v_cache=batch.v_cache.bfloat16())
    out = torch_paged.paged_attention(*attention_args(b16, head_dim**-0.5), use_native=True)
    assert out.dtype == torch.bfloat16
    exact = reference.paged_attention(
        b16.query.float(), b16.k_cache.float(), b16.v_cache.float(), batch.attn_metadata,
        head_dim**-0.5)
    starts = batch.query_start_loc.tolist()
    decode_rows = [starts[i] for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
    assert len(decode_rows) >= 10
    rows = torch.tensor(decode_rows)
    torch.testing.assert_close(out[rows].float(), exact[rows].bfloat16().float(),
                               rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(out.float(), exact, rtol=3e-2, atol=3e-2)
    fallback = torch_paged.paged_attention(*attention_args(b16, head_dim**-0.5),
                                           use_native=False)
    torch.testing.assert_close(out.float(), fallback.float(), rtol=3e-2, atol=3e-2)
    # As the engine runs a bf16 cache: the prompt tokens as kernel rows too (prefill_rows).
    meta = torch_paged.prepare_torch_metadata(batch.attn_metadata, block_size, num_kv_heads,
                                              prefill_rows=True)
    assert not meta.prefills and len(meta.decode_rows.query_rows) == sum(query_lens)
    as_rows = torch_paged.paged_attention(*attention_args(b16, head_dim**-0.5),
                                          torch_metadata=meta, use_native=True)
    torch.testing.assert_close(as_rows.float(), exact.bfloat16().float(), rtol=8e-3, atol=1e-5)
    assert torch.equal(as_rows[rows], out[rows])
