"""`pdserve up`'s memory plan (services/launcher/memory.py, issue 38): the estimate of an
engine's weights against what a real engine holds, and the one-line refusal of a plan that
cannot fit (the end-to-end refusal, exit 2 with nothing started: test_up.py)."""

from __future__ import annotations

import json
import struct

import pytest

from pdserve.services.cli import build_parser
from pdserve.services.launcher.config import config_from_args
from pdserve.services.launcher.memory import (
    ENGINE_OVERHEAD_BYTES,
    GATEWAY_BYTES,
    check_plan_fits,
    checkpoint_numel,
    engine_weight_bytes,
    has_panel_kernels,
    machine_memory,
    plan_memory,
)
from pdserve.services.launcher.plan import build_plan

GIB = 2 ** 30


def _plan(model_path: str, *argv: str):
    config = config_from_args(build_parser().parse_args(["up", "--model", model_path, *argv]))
    return build_plan(config, model_path, "m")


def test_the_checkpoint_is_counted_from_its_headers(tmp_path, monkeypatch):
    header = {"__metadata__": {"format": "pt"},
              "model.embed_tokens.weight": {"dtype": "F32", "shape": [10, 4],
                                            "data_offsets": [0, 160]},
              "model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [6, 4],
                                                    "data_offsets": [160, 208]}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw
                                                 + bytes(208))
    assert checkpoint_numel(tmp_path) == (64, 40)
    fp32 = (64 * 4, True) if has_panel_kernels() else (2 * 64 * 4, False)
    assert engine_weight_bytes(str(tmp_path), "float32", "cpu") == fp32
    bf16 = (64 * 2, has_panel_kernels())  # bf16 panels are mapped once per host too
    assert engine_weight_bytes(str(tmp_path), "bfloat16", "cpu") == bf16
    # vLLM's aliases and auto, as the engine resolves them
    assert engine_weight_bytes(str(tmp_path), "float", "cpu") == fp32
    from pdserve.kernels.cpu_features import has_bf16_instructions  # auto: bf16 if it has it

    assert engine_weight_bytes(str(tmp_path), "auto", "cpu") == (
        bf16 if has_bf16_instructions() else fp32)
    assert engine_weight_bytes(str(tmp_path), "half", "cpu") == (64 * 2, False)  # torch ops
    assert engine_weight_bytes(str(tmp_path), "float32", "cuda") == (0, False)
    assert engine_weight_bytes(str(tmp_path), "float32", "cpu", "int8") == (64 * 4, False)
    monkeypatch.setenv("PDSERVE_CPU_GEMV", "0")  # oneDNN: the plain and a packed copy
    assert engine_weight_bytes(str(tmp_path), "float32", "cpu") == (2 * 64 * 4, False)
    monkeypatch.delenv("PDSERVE_CPU_GEMV")
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", "0")  # panels, each engine its own
    assert engine_weight_bytes(str(tmp_path), "float32", "cpu")[1] is False


def test_the_estimate_matches_what_an_engine_holds(model_path, reference_llm):
    """SmolLM2 fp32 on the CPU: the estimate against EngineCore.memory_bytes of a real
    engine (weights as loaded, mapped or packed), within 2%; its KV pool is the budget."""
    held = reference_llm.engine.memory_bytes()
    weights = sum(n for kind, n in held.items() if kind != "kv_cache")
    estimate, shared = engine_weight_bytes(model_path, "float32", "cpu")
    assert shared == (held["mapped_weights"] > 0.99 * weights), held
    assert abs(estimate - weights) <= 0.02 * weights, (estimate, held)
    budget = 128 * 2**20  # reference_llm's kv_cache_memory
    assert 0.9 * budget <= held["kv_cache"] <= budget


def test_a_plan_is_the_sum_of_its_engines_and_the_gateway(model_path):
    plan = _plan(model_path, "--num-prefill", "2", "--num-decode", "3",
                 "--kv-cache-memory", "1GiB")
    children = plan_memory(plan)
    engines = [c for c in children if c.name != "gateway"]
    assert sorted(c.name for c in engines) == ["decode-0", "decode-1", "decode-2",
                                               "prefill-0", "prefill-1"]
    weights, shared = engine_weight_bytes(model_path, "float32", "cpu")
    assert all(c.kv_cache == GIB and c.overhead == ENGINE_OVERHEAD_BYTES for c in engines)
    # mapped from the host's weight cache: counted once, at the first engine
    assert [c.weights for c in engines] == (
        [weights] + [0] * 4 if shared else [weights] * 5)
    assert [c.total for c in children if c.name == "gateway"] == [GATEWAY_BYTES]
    need = sum(c.total for c in children)
    assert check_plan_fits(plan, memory=need) is None
    message = check_plan_fits(plan, memory=need - 1)
    assert message is not None and "\n" not in message
    assert message.startswith(f"this plan needs about {need / GIB:.1f} GiB of memory but the "
                              f"machine has {(need - 1) / GIB:.1f} GiB")
    assert "decode-0" in message and "--kv-cache-memory" in message and "--num-decode" in message


@pytest.mark.parametrize("kv, fits", [("2GiB", True), ("4TiB", False)])
def test_the_default_plan_fits_this_machine_and_a_huge_pool_does_not(model_path, kv, fits):
    assert machine_memory() > 8 * GIB  # the machines this runs on: 24 GiB
    assert (check_plan_fits(_plan(model_path, "--kv-cache-memory", kv)) is None) == fits
