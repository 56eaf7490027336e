"""`pdserve up --model A --model B`: several models behind one gateway.

    --model A [--served-model-name NAME]   the first model, as with one model (its flags)
    --model B --model C ...                each one more model, served under its derived name
                                           (a directory's base name, or the model's name)

Each model gets its own --num-prefill / --num-decode replicas (same engine flags), all of
them registered in the one Redis under their model's name; the one gateway serves them all
(`--extra-model NAME=PATH` each, services/gateway/multi_model.py) and routes every request
by its `model` among that model's instances only. Replicas of the later models continue the
numbering of the first's (prefill-1, decode-1, ... with one replica each) so that restarts
and the shutdown order treat them as any replica; the banner names each model's children.
--lora-modules load on the first model's replicas only.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plan.py imports config.py, which imports this module
    from pdserve.services.launcher.plan import ChildSpec, Plan


class _RepeatedModel(argparse.Action):
    """--model, repeatable: `model` is the first value, `models` all of them in order."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        models = [*(getattr(namespace, "models", None) or []), values]
        namespace.models = models
        setattr(namespace, self.dest, models[0])


def add_repeated_model_arg(parser: argparse.ArgumentParser) -> None:
    """Make EngineArgs' --model repeatable (its default and help kept)."""
    g = parser.add_argument_group("models", conflict_handler="resolve")  # replaces it
    g.add_argument(
        "--model", action=_RepeatedModel, default=parser.get_default("model"),
        help="HF directory, .gguf file, or SmolLM2-135M-Instruct (default); repeat it "
             "to serve more models behind the one gateway (each with its own replicas)")
    parser.set_defaults(models=None)


def resolve_extra_models(config, say: Callable[[str], None]) -> list[tuple[str, str]]:
    """(model directory, served name) of each later --model, checked and converted as the
    first one. Raises ValueError (a model pdserve does not serve, a name served twice) or
    prereqs.SetupError."""
    from pdserve.services.launcher.prereqs import ensure_model, served_model_name
    from pdserve.shared.models.architectures import check_model_dir

    out = []
    for model in config.extra_models:
        check_model_dir(model, config.engine_args.max_model_len)
        path = ensure_model(model, say)
        dataclasses.replace(config.engine_args, model=path,
                            served_model_name=None).create_engine_configs()
        out.append((path, served_model_name(model, path, None)))
    return out


def add_models(plan: Plan, config, models: list[tuple[str, str]],
               python: str = sys.executable) -> Plan:
    """`plan` (the first model's) with each of `models`' replicas and the gateway's
    --extra-model flags.

    Raises:
        ValueError: two models under one served name.
    """
    from pdserve.services.launcher.plan import build_plan

    names = [plan.served_model_name, *(name for _, name in models)]
    if len(set(names)) != len(names):
        raise ValueError(f"two --model flags serve the same name: {names} (give the first "
                         "one another --served-model-name, or rename a directory)")
    children = list(plan.children)
    used = {port for spec in children for port in spec.ports}
    counts = {role: sum(spec.name.startswith(role + "-") for spec in children)
              for role in ("prefill", "decode")}
    extra_flags: list[str] = []
    # NOTE: free internal ports; the first model's fixed bases (--prefill-port ...) would
    # collide. The later models' Redis is the first one's.
    base = dataclasses.replace(config, redis_url=plan.redis_url, lora_modules=(),
                               prefill_port=None, decode_port=None,
                               prefill_metrics_port=None, decode_metrics_port=None)
    for path, name in models:
        for _ in range(5):  # free_ports of two plans may pick one port twice: pick again
            engines = [s for s in build_plan(base, path, name, python,
                                             first_engine_rank=sum(counts.values())).children
                       if s.name != "gateway"]
            if not used & {p for s in engines for p in s.ports}:
                break
        else:
            raise ValueError("could not pick distinct free ports for model " + name)
        for spec in engines:
            role = spec.name.rsplit("-", 1)[0]
            children.insert(-1, dataclasses.replace(spec, name=f"{role}-{counts[role]}"))
            counts[role] += 1
            used.update(spec.ports)
        extra_flags += ["--extra-model", f"{name}={path}"]
    gateway = children[-1]
    assert gateway.name == "gateway"
    children[-1] = dataclasses.replace(gateway, argv=(*gateway.argv, *extra_flags))
    return dataclasses.replace(plan, children=tuple(children))


def model_of(spec: ChildSpec) -> str | None:
    """The served model name an engine child's command line carries (None: not an engine)."""
    argv = list(spec.argv)
    if "serve" not in argv or "--served-model-name" not in argv or spec.name == "gateway":
        return None
    return argv[argv.index("--served-model-name") + 1]
