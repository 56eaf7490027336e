"""scripts/gpu_check.sh end to end in its dry mode (the CPU, tiny sizes), and
scripts/gpu_prepare.sh's split of the model with gpu_model.sh's join (offline, a small
file): the GPU check is tested before it meets a GPU."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STEPS = ["setup", "nvidia_smi", "gpu_tests", "model", "parity_suite", "agreement",
         "engine_bench"]
CUDA_ONLY = {"nvidia_smi"}


def _bash(*args: str, env: dict | None = None, timeout: float = 60):
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def _fake_gguf(path: Path, size: int = 10_000) -> bytes:
    data = bytes((i * 7 + 3) % 256 for i in range(size))
    path.write_bytes(data)
    return data


@pytest.fixture(scope="module")
def dry_run(model_path, tmp_path_factory):
    """One dry run of every stage; its model parts are a small fake GGUF split in two (the
    converted model is already cached, so `convert` does not read it)."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    src = tmp / GGUF_NAME
    _fake_gguf(src)
    split = _bash("scripts/gpu_model.sh", "split", str(src), str(tmp / "parts"), "2")
    assert split.returncode == 0, split.stderr
    out = tmp / "out"
    proc = _bash("scripts/gpu_check.sh", "--dry-run", "--out", str(out), "--timeout", "170",
                 "--model-parts", str(tmp / "parts"),
                 env={"PYTHON": sys.executable, "OMP_WAIT_POLICY": "PASSIVE"}, timeout=400)
    return proc, out


def test_dry_run_passes_every_step(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] is True and result["ok"] is True
    assert result["device"] == "cpu" and result["stage"] == "all"
    assert [s["name"] for s in result["steps"]] == STEPS
    for step in result["steps"]:
        want = "skipped" if step["name"] in CUDA_ONLY else "passed"
        assert step["status"] == want, step
        if want == "passed":
            assert step["rc"] == 0 and step["seconds"] > 0, step


def test_dry_run_reports_real_numbers(dry_run):
    _, out = dry_run
    steps = {s["name"]: s["data"] for s in
             json.loads((out / "gpu_check.json").read_text())["steps"]}
    assert steps["setup"]["versions"]["torch"] and not steps["setup"]["missing"]
    gpu = steps["gpu_tests"]  # collected and skipped on the CPU, not errored
    assert gpu["tests"] > 0 and gpu["skipped"] == gpu["tests"]
    assert gpu["errors"] == gpu["failures"] == 0
    assert steps["model"]["joined"] is True and Path(steps["model"]["model_path"]).is_dir()
    assert steps["parity_suite"]["passed"] == steps["parity_suite"]["tests"] == 2

    agree = steps["agreement"]
    assert agree["num_prompts"] == len(agree["prompts"]) == 2
    for row in agree["prompts"]:
        assert 0 <= row["agree_same_dtype"] <= row["engine_tokens"] <= 8
        assert 0 <= row["agree_fp32"] <= 8
    # fp32 on the CPU: the engine is token-identical to transformers (the parity suite's
    # claim), so every prompt agrees to its end.
    assert agree["num_identical_same_dtype"] == 2

    bench = steps["engine_bench"]
    for engine in (bench["engine"], bench["engine_eager"]):
        assert engine["mixed"]["requests"] == 4
        assert engine["mixed"]["output_tokens"] == 32  # 4 requests, max_tokens cut to 8
        assert engine["mixed"]["output_tok_per_s"] > 0
        assert [s["batch"] for s in engine["decode_step"]] == [1, 4]
        for s in engine["decode_step"]:
            assert s["num_running"] == s["batch"] and s["step_s_median"] > 0
            assert s["graph_replays"] == 0
        assert engine["memory"]["kv_pool_bytes"] > 0
        assert engine["cuda_graphs"]["graphs_used"] is False  # no CUDA graphs on the CPU
    assert bench["transformers_batched"]["output_tok_per_s"] > 0
    assert bench["speedup_over_transformers"] > 0


def test_dry_run_logs_every_step_and_prints_the_table_last(dry_run):
    proc, out = dry_run
    log = (out / "gpu_check.log").read_text()
    for name in STEPS:
        if name in CUDA_ONLY:
            assert f"step {name}: skipped" in log
        else:
            assert f"=== step {name} (" in log and f"=== step {name}: passed" in log
    gpu = json.loads((out / "gpu_check.json").read_text())["steps"][STEPS.index("gpu_tests")]
    assert f"{gpu['data']['skipped']} skipped" in log  # pytest's own summary line
    assert f"/{GGUF_NAME} (10000 bytes, sha256 checked)" in log  # the model step's join
    assert '"num_identical_fp32"' in log and '"speedup_over_transformers"' in log
    lines = proc.stdout.rstrip().splitlines()
    assert lines[-1] == "== gpu_check: all ok"
    table = lines[-len(STEPS) - 1:-1]
    assert [row.split()[0] for row in table] == STEPS
    assert lines[-len(STEPS) - 2].startswith("step ")
    assert log.rstrip().endswith("== gpu_check: all ok")


def test_prepare_splits_offline_and_join_restores_the_file(tmp_path):
    src = tmp_path / GGUF_NAME
    data = _fake_gguf(src, 100_001)
    dest = tmp_path / "gpu"
    proc = _bash("scripts/gpu_prepare.sh", "--no-download", "--model", str(src),
                 "--dest", str(dest))
    assert proc.returncode == 0, proc.stderr
    manifest = dict(line.split("=", 1)
                    for line in (dest / "model" / "MANIFEST").read_text().splitlines())
    assert manifest["name"] == GGUF_NAME and int(manifest["size"]) == len(data)
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    parts = manifest["parts"].split()
    assert parts == ["part.00", "part.01"]
    assert b"".join((dest / "model" / p).read_bytes() for p in parts) == data
    # Two calls, each carrying the wheels, the MANIFEST and one part.
    assert "--stage 1" in proc.stdout and "--stage 2" in proc.stdout
    assert proc.stdout.count("/model/MANIFEST") == 2
    assert "part.00" in proc.stdout and "part.01" in proc.stdout

    joined = tmp_path / "joined" / GGUF_NAME
    proc = _bash("scripts/gpu_model.sh", "join", str(dest / "model"), str(joined))
    assert proc.returncode == 0, proc.stderr
    assert joined.read_bytes() == data


def test_join_names_a_missing_part_and_refuses_a_corrupt_one(tmp_path):
    src = tmp_path / "model.gguf"
    _fake_gguf(src, 5_000)
    parts = tmp_path / "parts"
    assert _bash("scripts/gpu_model.sh", "split", str(src), str(parts), "3").returncode == 0
    (parts / "part.01").unlink()  # the machine went cold between the calls
    proc = _bash("scripts/gpu_model.sh", "join", str(parts), str(tmp_path / "out"))
    assert proc.returncode == 3 and "part.01" in proc.stderr
    assert not (tmp_path / "out").exists()

    assert _bash("scripts/gpu_model.sh", "split", str(src), str(parts), "2").returncode == 0
    (parts / "part.00").write_bytes(b"x" + (parts / "part.00").read_bytes()[1:])
    proc = _bash("scripts/gpu_model.sh", "join", str(parts), str(tmp_path / "out"))
    assert proc.returncode == 4 and "sha256" in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_stash_carries_a_part_from_one_call_to_the_next(tmp_path):
    """Call 1 carries part.00, call 2 part.01: each call's start stashes what it carried
    outside the tree, so call 2's join has both even if its tree lost part.00."""
    src = tmp_path / "model.gguf"
    data = _fake_gguf(src, 5_000)
    whole, stash = tmp_path / "whole", tmp_path / "stash"
    assert _bash("scripts/gpu_model.sh", "split", str(src), str(whole), "2").returncode == 0
    calls = []
    for part in ("part.00", "part.01"):
        tree = tmp_path / f"call-{part}"
        tree.mkdir()
        for name in ("MANIFEST", part):
            (tree / name).write_bytes((whole / name).read_bytes())
        proc = _bash("scripts/gpu_model.sh", "stash", str(tree), str(stash))
        assert proc.returncode == 0, proc.stderr
        calls.append((tree, proc.stdout))
    tree, stdout = calls[1]
    assert "part.00" in stdout and sorted(p.name for p in tree.iterdir()) == [
        "MANIFEST", "part.00", "part.01"]
    assert _bash("scripts/gpu_model.sh", "join", str(tree), str(tmp_path / "out")
                 ).returncode == 0
    assert (tmp_path / "out").read_bytes() == data
    # Another model's parts empty the stash first: no stale part is ever joined.
    _fake_gguf(src, 6_000)
    other = tmp_path / "other"
    assert _bash("scripts/gpu_model.sh", "split", str(src), str(other), "2").returncode == 0
    (other / "part.01").unlink()
    assert _bash("scripts/gpu_model.sh", "stash", str(other), str(stash)).returncode == 0
    assert not (other / "part.01").exists()
    assert sorted(p.name for p in stash.iterdir()) == ["MANIFEST", "part.00"]


def test_prepare_fails_when_a_call_would_carry_too_much(tmp_path):
    src = tmp_path / "model.gguf"
    _fake_gguf(src, 2 * 1024 * 1024)
    proc = _bash("scripts/gpu_prepare.sh", "--no-download", "--model", str(src),
                 "--dest", str(tmp_path / "gpu"), "--parts", "1",
                 env={"LIMIT_MIB": "1"})
    assert proc.returncode == 1 and "over 1 MiB" in proc.stderr


def test_markdown_section_carries_the_measured_numbers(dry_run):
    """`gpu_check_report.py markdown` (the docs/benchmarks.md section a GPU session pastes)
    holds every step once, even from two stages' files, and the run's own numbers."""
    _, out = dry_run
    result = json.loads((out / "gpu_check.json").read_text())
    report = subprocess.run(
        [sys.executable, "scripts/gpu_check_report.py", "markdown", str(out / "gpu_check.json"),
         str(out / "gpu_check.json")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    text = report.stdout
    assert "**dry run (CPU)**" in text
    for name in STEPS:
        assert text.count(f"| {name} |") == 1, name
    bench = next(s["data"] for s in result["steps"] if s["name"] == "engine_bench")
    graphs, eager = bench["engine"], bench["engine_eager"]
    assert (f"| {graphs['mixed']['output_tok_per_s']:.0f} | "
            f"{eager['mixed']['output_tok_per_s']:.0f} | ") in text
    assert f"{bench['speedup_over_transformers']:.2f}x" in text
    for g, e in zip(graphs["decode_step"], eager["decode_step"]):
        assert (f"| {g['batch']} | {g['step_s_median'] * 1e3:.2f} | "
                f"{e['step_s_median'] * 1e3:.2f} |") in text
    agreement = next(s["data"] for s in result["steps"] if s["name"] == "agreement")
    assert len([line for line in text.splitlines() if line.startswith("| 0 | ")]) == 1
    assert agreement["prompts"][0]["agree_fp32"] > 0
