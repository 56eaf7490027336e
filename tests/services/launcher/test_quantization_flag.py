"""--quantization flows from `pdserve up` (and PDSERVE_QUANTIZATION, compose) to both engine
roles, and reaches the frozen ModelConfig; bad values are refused naming the flag."""

from __future__ import annotations

import argparse

import pytest

from pdserve.services.cli import build_parser
from pdserve.services.launcher.config import config_from_args
from pdserve.services.launcher.plan import build_plan
from pdserve.shared.engine_args import EngineArgs


def _engine_args_of_children(*argv: str) -> dict[str, EngineArgs]:
    config = config_from_args(build_parser().parse_args(["up", "--cpu-cores", "0-1", *argv]))
    plan = build_plan(config, "/models/m", "m", python="python")
    parser = build_parser()
    return {c.name: EngineArgs.from_cli_args(parser.parse_args(list(c.argv[3:])))
            for c in plan.children if c.name.startswith(("prefill", "decode"))}


def test_up_passes_quantization_to_every_engine():
    engines = _engine_args_of_children("--quantization", "int8", "--num-decode", "2")
    assert set(engines) == {"prefill-0", "decode-0", "decode-1"}
    assert {e.quantization for e in engines.values()} == {"int8"}


@pytest.mark.fp32_only  # an int8 suite run makes int8 every engine's default
def test_up_default_is_none():
    engines = _engine_args_of_children()
    assert {e.quantization for e in engines.values()} == {"none"}


def test_environment_variable_sets_the_default(monkeypatch):
    monkeypatch.setenv("PDSERVE_QUANTIZATION", "int8")
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args([])
    assert EngineArgs.from_cli_args(ns).quantization == "int8"
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--quantization", "none"])
    assert EngineArgs.from_cli_args(ns).quantization == "none"


def test_unknown_mode_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--quantization", "int4", "--prompt", "x"])


def test_model_config_carries_the_mode(model_path):
    model_config = EngineArgs(model=model_path, quantization="int8").create_engine_configs()[0]
    assert model_config.quantization == "int8"
    args = EngineArgs(model=model_path, quantization="none")
    assert args.create_engine_configs()[0].quantization == "none"


@pytest.mark.parametrize("changes", [{"quantization": "int4"}, {"device": "cuda"},
                                     {"dtype": "bfloat16"}])
def test_bad_combinations_raise_naming_the_flag(model_path, changes):
    args = EngineArgs(model=model_path, **{"quantization": "int8", **changes})
    with pytest.raises(ValueError, match="quantization"):
        args.create_engine_configs()


def test_compose_passes_pdserve_quantization_to_both_engines():
    from tests.services.launcher.test_compose import ENGINES, _config

    for env, expected in (({}, "none"), ({"PDSERVE_QUANTIZATION": "int8"}, "int8")):
        services = _config(env=env)["services"]
        assert {services[name]["environment"]["PDSERVE_QUANTIZATION"]
                for name in ENGINES} == {expected}
