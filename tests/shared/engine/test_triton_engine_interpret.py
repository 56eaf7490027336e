"""The engine end to end on `attention_backend="triton"` (the `--device cuda` default), with
the Triton kernels run by the CPU interpreter: the same Python path as on a GPU but the
device, against the torch backend. A 2-layer cut of the default model keeps it fast.

Covers chunked prefill, a prefix-cache hit, batched decodes, speculative drafts scored
through the prefill kernel (n-gram) and prompt logprobs; fp32 only (the interpreter's bf16
tl.dot is wrong, see tests/kernels/triton_interpret_checks.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def results(model_path, tmp_path_factory) -> dict:
    from tests.draft_model import write_truncated_model

    small = write_truncated_model(model_path, tmp_path_factory.mktemp("small"), 2)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "tests.shared.engine.triton_engine_checks", small],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_greedy_tokens_equal_the_torch_backend(results):
    assert all(len(ids) == 6 for ids in results["torch"])
    assert results["triton"] == results["torch"]


def test_speculative_drafts_scored_by_the_triton_kernels(results):
    assert results["ngram_stats"]["num_draft_tokens"] > 0
    assert results["triton_ngram"] == results["torch"]


def test_prompt_logprobs_match_the_torch_backend(results):
    for triton_row, torch_row in zip(results["triton_prompt_logprobs"],
                                     results["torch_prompt_logprobs"]):
        assert triton_row[0] is None and torch_row[0] is None
        assert len(triton_row) == len(torch_row) > 1
        for a, b in zip(triton_row[1:], torch_row[1:]):
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4), (a, b)
