"""Each Triton kernel, run by Triton's CPU interpreter, against the reference (fp32).

The checks run in one subprocess with TRITON_INTERPRET=1 (`triton_interpret_checks.py`):
the flag only takes effect if set before triton is imported, so setting it here could be
spoiled by, or leak into, other test modules.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["store_kv_cache", "decode", "decode_gqa3_head_dim24", "prefill", "mixed",
          "graph_padded_decode", "window_soft_cap"]

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton_interpret_checks"], cwd=REPO_ROOT,
        env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    results: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("check", CHECKS)
def test_triton_kernel_matches_reference(interpreter_results: dict[str, float], check: str) -> None:
    assert interpreter_results[check] < 1e-4, interpreter_results
