"""`pdserve up --device cuda`: the engines get the static core split, not the core share
(which sizes CPU compute per step; on a GPU the GPU computes)."""

from __future__ import annotations

from pdserve.services.cli import build_parser
from pdserve.services.launcher.config import config_from_args
from pdserve.services.launcher.cores import format_cores
from pdserve.services.launcher.plan import build_plan
from pdserve.shared.engine_args import EngineArgs


def _engines(*argv: str) -> list[tuple[tuple[int, ...], EngineArgs]]:
    config = config_from_args(build_parser().parse_args(["up", *argv]))
    plan = build_plan(config, "/m", "m")
    parser = build_parser()
    return [(spec.cores, EngineArgs.from_cli_args(parser.parse_args(list(spec.argv[3:]))))
            for spec in plan.children if spec.name.startswith(("prefill", "decode"))]


def test_cuda_engines_get_the_static_split_without_the_core_share():
    engines = _engines("--cpu-cores", "0-3", "--device", "cuda")
    assert [cores for cores, _ in engines] == [(0, 1), (2, 3)]
    for cores, engine in engines:
        assert engine.device == "cuda"
        assert engine.core_share == "" and engine.cpu_cores == format_cores(cores)


def test_cuda_engines_unbound_with_no_cpu_split():
    engines = _engines("--cpu-cores", "0-3", "--device", "cuda", "--no-cpu-split")
    assert [(cores, e.core_share, e.cpu_cores) for cores, e in engines] == [((), "", "")] * 2


def test_cpu_engines_keep_the_core_share():
    engines = _engines("--cpu-cores", "0-3")
    assert [cores for cores, _ in engines] == [(0, 1, 2, 3)] * 2
    assert all(engine.core_share for _, engine in engines)
