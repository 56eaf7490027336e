"""Batched multi-LoRA kernels against the token-by-token reference: the CPU segment loop
(`kernels/lora_cpu.py`) over the step mappings `shared/lora/mapping.py` builds (runs kept as
they are, or gathered and sorted), the padded-bmm alternative (these with the C kernel
switched off, as a machine without a compiler runs), the C BGMV kernel (`csrc/lora_cpu.c`),
and the Triton SGMV kernels under TRITON_INTERPRET=1 (in a subprocess, as
test_triton_interpret.py runs its kernels)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.kernels.lora_cpu import (
    add_lora_bgmv,
    add_lora_bmm,
    add_lora_segments,
    load_kernel,
    lora_parts,
    lora_reference,
)
from pdserve.shared.lora.mapping import BGMV_MAX_TOKENS, PADDED_MAX_TOKENS, build_lora_mapping

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture
def torch_forms(monkeypatch):
    """The torch formulations: the C kernel off (PDSERVE_CPU_LORA=0)."""
    monkeypatch.setenv("PDSERVE_CPU_LORA", "0")


def make_weights(num_slots: int, rank: int, in_features: int, out_features: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_slots, rank, in_features, generator=g),
            torch.randn(num_slots, out_features, rank, generator=g))


@pytest.mark.parametrize("request_slots, q_lens, sorted_form", [
    ([0, 0, 0], [1, 1, 5], False),             # one adapter: one run, no gather
    ([1, 1, -1, 0, 0], [1, 1, 1, 4, 1], False),  # grouped by adapter: runs
    ([1, -1, 0, 2, 1, 0, 2, 1], [1] * 8, True),  # interleaved decodes: sorted
    ([0, 1, -1, 1, 0], [1, 9, 3, 1, 6], True),
])
def test_segment_loop_matches_the_reference(request_slots, q_lens, sorted_form,
                                            torch_forms):
    lora_a, lora_b = make_weights(3, 6, 10, 14, seed=0)
    mapping = build_lora_mapping(request_slots, np.asarray(q_lens), CPU)
    assert mapping is not None and (mapping.token_indices is not None) == sorted_form
    token_slots = torch.from_numpy(np.repeat(np.asarray(request_slots), q_lens))
    x = torch.randn(len(token_slots), 10)
    y = torch.randn(len(token_slots), 14)
    rank = [6, 3, 6]  # slot 1 holds a smaller rank: only its first 3 columns are read
    a_t = [lora_a[s, :rank[s]].t() for s in range(3)]
    b_t = [lora_b[s, :, :rank[s]].t() for s in range(3)]
    lora_a[1, 3:] = 0
    expected = y + lora_reference(x, lora_a, lora_b, token_slots)
    add_lora_segments(y, x, a_t, b_t, mapping.segments, mapping.token_indices)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("request_slots, q_lens", [
    ([1, -1, 0, 2, 1, 0, 2, 2], [1] * 8),  # decodes and a base row; slot 2 has one more
    ([1, 0, 2, 1, 0, 2], [1] * 6),         # evenly spread: no padding at all
    ([1, -1, 0, 2, 1, 0, 2, 1], [1, 1, 1, 1, 1, 1, 1, 2]),  # padding: slot 1 has 4
])
def test_balanced_steps_get_the_padded_bmm_form(request_slots, q_lens, torch_forms):
    lora_a, lora_b = make_weights(3, 6, 10, 14, seed=2)
    mapping = build_lora_mapping(request_slots, np.asarray(q_lens), CPU, num_slots=3)
    assert mapping is not None and mapping.padded is not None
    token_slots = torch.from_numpy(np.repeat(np.asarray(request_slots), q_lens))
    x, y = torch.randn(len(token_slots), 10), torch.randn(len(token_slots), 14)
    expected = y + lora_reference(x, lora_a, lora_b, token_slots)
    add_lora_bmm(y, x, lora_a, lora_b, *mapping.padded)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # a long chunk beside decodes would pad every slot to it: the loop instead
    chunky = build_lora_mapping([0, 1, 2], np.asarray([30, 1, 1]), CPU, num_slots=3)
    assert chunky.padded is None and chunky.token_indices is None


def test_a_long_prefill_goes_as_runs_without_gather_or_padding(torch_forms):
    """Prefill chunks of four adapters in turn (8 runs of 40 tokens): many runs, but long
    ones, go as they are (no gather, no scatter), and past PADDED_MAX_TOKENS never padded;
    the answer is the reference's."""
    lora_a, lora_b = make_weights(4, 6, 10, 14, seed=5)
    request_slots, q_lens = [0, 1, 2, 3, 0, 1, 2, 3], [40] * 8
    mapping = build_lora_mapping(request_slots, np.asarray(q_lens), CPU, num_slots=4)
    assert mapping.token_indices is None and mapping.padded is None
    assert mapping.segments == [(s % 4, 40 * s, 40 * s + 40) for s in range(8)]
    token_slots = torch.from_numpy(np.repeat(np.asarray(request_slots), q_lens))
    x, y = torch.randn(320, 10), torch.randn(320, 14)
    expected = y + lora_reference(x, lora_a, lora_b, token_slots)
    add_lora_segments(y, x, [a.t() for a in lora_a], [b.t() for b in lora_b],
                      mapping.segments, mapping.token_indices)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # balanced but past PADDED_MAX_TOKENS: sorted segments, not padded
    decodes = build_lora_mapping([0, 1, 2, 3] * 80, np.ones(320, np.int64), CPU, num_slots=4)
    assert decodes.padded is None and decodes.token_indices is not None
    assert 320 > PADDED_MAX_TOKENS


def test_one_adapter_in_a_later_slot_between_base_rows(torch_forms):
    """Only slot 1 of 2 in use, its rows between base rows (the padded form would have a row
    per slot: it must not be sized by the count of the step's adapters)."""
    lora_a, lora_b = make_weights(2, 6, 10, 14, seed=4)
    request_slots, q_lens = [1, -1, 1, -1, 1], [1] * 5
    mapping = build_lora_mapping(request_slots, np.asarray(q_lens), CPU, num_slots=2)
    token_slots = torch.tensor(request_slots)
    x, y = torch.randn(5, 10), torch.randn(5, 14)
    expected = y + lora_reference(x, lora_a, lora_b, token_slots)
    if mapping.padded is not None:
        add_lora_bmm(y, x, lora_a, lora_b, *mapping.padded)
    else:
        add_lora_segments(y, x, [a.t() for a in lora_a], [b.t() for b in lora_b],
                          mapping.segments, mapping.token_indices)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


needs_kernel = pytest.mark.skipif(load_kernel() is None, reason="no C compiler here")


@needs_kernel
@pytest.mark.parametrize("request_slots, q_lens", [
    ([1, -1, 0, 2, 1, 0, 2, 1], [1] * 8),     # interleaved decodes and a base row
    ([2], [1]),                               # one stream
    ([0, 3, -1, 3], [5, 1, 1, 9]),            # short chunks beside decodes; slot 3: no LoRA
    ([1, 0, 2, 1] * 16, [1] * 64),            # the most tokens the kernel takes
])
def test_bgmv_kernel_matches_the_reference(request_slots, q_lens):
    """Fused-layer adapters (A stacked, B block-diagonal over three parts of 20/6/6 outputs),
    one adapter targeting only the first part, one slot without LoRA in this layer: the C
    kernel adds exactly what the token-by-token reference does, reading only B's blocks."""
    g = torch.Generator().manual_seed(5)
    num_slots, rank, n_in, sizes = 4, 4, 24, (20, 6, 6)
    lora_a = torch.randn(num_slots, 3 * rank, n_in, generator=g)
    lora_b = torch.zeros(num_slots, sum(sizes), 3 * rank)
    row = 0
    for p, size in enumerate(sizes):
        lora_b[:, row:row + size, p * rank:(p + 1) * rank] = torch.randn(
            num_slots, size, rank, generator=g)
        row += size
    lora_b[1, :, rank:] = 0      # slot 1: the first part only
    lora_a[1, rank:] = 0
    lora_a[3], lora_b[3] = 0, 0  # slot 3: no LoRA in this layer
    slot_rank = torch.tensor([3 * rank, rank, 3 * rank, 0])
    blocks = [lora_parts(lora_b[s]) for s in range(num_slots)]
    assert blocks[0] == [(0, 20, 0, 4), (20, 26, 4, 8), (26, 32, 8, 12)]
    assert blocks[1] == [(0, 20, 0, 4)] and blocks[3] == []
    parts = torch.zeros(num_slots, 3 * rank, 4, dtype=torch.int64)
    for s, b in enumerate(blocks):
        if b:
            parts[s, :len(b)] = torch.tensor(b)
    num_parts = torch.tensor([len(b) for b in blocks])
    mapping = build_lora_mapping(request_slots, np.asarray(q_lens), CPU, num_slots=num_slots)
    assert mapping.token_slots is not None and mapping.padded is None
    token_slots = torch.from_numpy(np.repeat(np.asarray(request_slots), q_lens))
    assert mapping.token_slots.tolist() == token_slots.tolist()
    x = torch.randn(len(token_slots), n_in, generator=g)
    y = torch.randn(len(token_slots), sum(sizes), generator=g)
    expected = y + lora_reference(x, lora_a, lora_b, token_slots)
    # x as a view with a row stride past its width (the first columns of a wider tensor)
    wide = torch.zeros(len(token_slots), 2 * n_in)
    wide[:, :n_in] = x
    assert add_lora_bgmv(y, wide[:, :n_in], lora_a, lora_b.transpose(1, 2).contiguous(),
                         mapping.token_slots, slot_rank, parts, num_parts)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_kernel_takes_decode_sized_steps_only(monkeypatch):
    """Past BGMV_MAX_TOKENS a step goes to BLAS's matmuls; PDSERVE_CPU_LORA=0 turns it off."""
    big = build_lora_mapping([0, 1], np.asarray([BGMV_MAX_TOKENS, 1]), CPU, num_slots=2)
    assert big.token_slots is None
    monkeypatch.setenv("PDSERVE_CPU_LORA", "0")
    assert build_lora_mapping([0, 1], np.asarray([1, 1]), CPU, num_slots=2).token_slots is None


def test_a_step_without_adapters_has_no_mapping():
    assert build_lora_mapping([-1, -1], np.asarray([1, 7]), CPU) is None


def test_triton_sgmv_under_the_interpreter_matches_the_reference():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "tests.kernels.lora_interpret_checks"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(errors) == {"decode_mixed", "prefill_mixed", "one_adapter"}
    assert all(e < 1e-5 for e in errors.values()), errors


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_sgmv_on_cuda_matches_the_reference(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pdserve.kernels.triton_lora import add_lora_sgmv

    request_slots, q_lens = [0, 1, -1, 1, 0, 2], [1, 37, 5, 1, 20, 1]
    lora_a, lora_b = make_weights(3, 48, 576, 960, seed=3)
    lora_a, lora_b = (w.mul(0.05).to("cuda", dtype) for w in (lora_a, lora_b))
    mapping = build_lora_mapping(request_slots, np.asarray(q_lens), torch.device("cuda"))
    token_slots = torch.from_numpy(np.repeat(np.asarray(request_slots), q_lens))
    x = torch.randn(len(token_slots), 576, device="cuda", dtype=dtype)
    y = torch.randn(len(token_slots), 960, device="cuda", dtype=dtype)
    expected = y.float() + lora_reference(x.float().cpu(), lora_a.float().cpu(),
                                          lora_b.float().cpu(), token_slots).cuda()
    add_lora_sgmv(y, x, lora_a, lora_b, *mapping.sgmv)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3  # TF32 dots
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol)
