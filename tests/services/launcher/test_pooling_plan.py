"""`pdserve up --runner pooling` / `--convert embed` (issue 32): prefill replicas and the
gateway only, the pooler flags passed through, bad ones refused before anything starts."""

from __future__ import annotations

import pytest

from pdserve.services.cli import build_parser
from pdserve.services.launcher.config import config_from_args
from pdserve.services.launcher.plan import build_plan
from pdserve.shared.engine_args import EngineArgs
from pdserve.shared.pooling_params import PoolerConfig

MEAN = '{"pooling_type": "MEAN", "normalize": true}'


def _config(*argv: str):
    return config_from_args(build_parser().parse_args(["up", *argv]))


@pytest.mark.parametrize("argv", [("--runner", "pooling"), ("--convert", "embed")])
def test_a_pooling_plan_starts_no_decode(argv):
    plan = build_plan(_config(*argv, "--override-pooler-config", MEAN, "--num-decode", "2",
                              "--num-prefill", "2"), "/m", "m")
    names = [c.name for c in plan.children]
    assert names == ["redis", "prefill-0", "prefill-1", "gateway"]
    parser = build_parser()
    engine = EngineArgs.from_cli_args(parser.parse_args(list(plan.children[1].argv[3:])))
    assert PoolerConfig.from_flags(engine.pooler_config, engine.override_pooler_config) == \
        PoolerConfig("MEAN", True)
    gateway = parser.parse_args(list(plan.children[-1].argv[3:]))
    assert gateway.runner == "pooling" and gateway.decode_url == [""]


def test_a_pooling_plan_without_core_share_gives_the_prefills_every_core():
    plan = build_plan(_config("--runner", "pooling", "--cpu-cores", "0-1", "--no-cpu-share"),
                      "/m", "m")
    assert [c.cores for c in plan.children if c.name.startswith("prefill")] == [(0, 1)]


def test_bad_pooling_flags_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        _config("--runner", "pooling", "--pooler-config", '{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="needs --runner pooling"):
        _config("--runner", "generate", "--convert", "embed")
    ns = build_parser().parse_args(["serve", "decode", "--model", "/m", "--runner", "pooling"])
    assert ns.func(ns) == 2  # a pooling model has no decode role
    with pytest.raises(ValueError, match="not supported"):
        PoolerConfig.from_value({"pooling_type": "LAST", "dimensions": 3})
