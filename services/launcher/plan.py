"""The launch plan: every child's command line, environment, ports, cores and health probe.

Pure: given the config, the resolved model and the ports, it starts nothing, so tests can
check the command lines directly.

    start order:     redis ─▶ prefill-0.. , decode-0.. , gateway   (all at once once Redis is up)
    KV events:       engine k (prefill-0.. then decode-0.., k from 0) publishes on the
                     --kv-events-config endpoint's port + k (replay endpoint likewise), as
                     vLLM offsets per data-parallel rank: one host, one port per engine
    shutdown stage:  0 gateway (stop taking requests, finish in-flight ones)
                     1 prefill and decode replicas (drain)
                     2 redis
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from pdserve.services.common.kv_events import KVEventsConfig, offset_endpoint_port
from pdserve.services.launcher.config import UpConfig
from pdserve.services.launcher.cores import (
    Cores,
    CoreSplit,
    available_cores,
    distribute,
    format_cores,
    split_cores,
)
from pdserve.shared.engine.core_share import default_board_path
from pdserve.shared.engine_args import EngineArgs
from pdserve.shared.pooling_params import resolve_runner

ProbeKind = Literal["redis", "grpc", "http"]
# NOTE: these describe one instance; inherited by several children they would collide
# (two instances with one id), so children never see them: the launcher passes flags.
_PER_INSTANCE_ENV = ("PDSERVE_HOST", "PDSERVE_PORT", "PDSERVE_METRICS_PORT",
                     "PDSERVE_INSTANCE_ID", "PDSERVE_ADVERTISE_ADDRESS", "PDSERVE_REDIS_URL",
                     "PDSERVE_PREFILL_URL", "PDSERVE_DECODE_URL", "PDSERVE_API_KEY",
                     "PDSERVE_ADMIN_API_KEY",
                     "PDSERVE_CPU_CORES", "PDSERVE_INTERNAL_TOKEN")


class Probe(NamedTuple):
    kind: ProbeKind
    target: str
    """host:port (redis, grpc) or a URL (http)."""


@dataclass(frozen=True)
class ChildSpec:
    name: str
    """Log prefix and display name: redis, prefill-0, decode-0, gateway."""
    argv: tuple[str, ...]
    probe: Probe
    stage: int
    """Shutdown order: lower stops first."""
    ports: tuple[int, ...] = ()
    """Ports the child listens on (all must be closed after shutdown)."""
    cores: Cores = ()
    env: Mapping[str, str] = field(default_factory=dict)
    """Set on top of the launcher's environment."""


@dataclass(frozen=True)
class Plan:
    children: tuple[ChildSpec, ...]
    """In start order; Redis first when the launcher runs one."""
    gateway_url: str
    """http://host:port as a client on this machine reaches it."""
    redis_url: str
    served_model_name: str


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held together while picking, so distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def connect_host(host: str) -> str:
    """Where a local client connects for a server bound to `host`."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment every child starts from: unbuffered, offline, no per-instance vars."""
    env = {k: v for k, v in environ.items() if k not in _PER_INSTANCE_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def engine_flags(args: EngineArgs) -> list[str]:
    """EngineArgs back into flags. Booleans are passed only when they differ from the
    default, so both `store_true` and `--x/--no-x` flags round-trip."""
    defaults = EngineArgs()
    out: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        flag = "--" + f.name.replace("_", "-")
        if value is None or (f.name in ("cpu_cores", "core_share", "kv_offload_dir")
                             and not value):
            continue
        if isinstance(value, bool):
            if value != getattr(defaults, f.name):
                out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def _tier_of(args: EngineArgs, role: str, i: int) -> EngineArgs:
    """The engine's own disk tier, `<--kv-offload-dir>/<role>-<i>`: the same after a
    restart, so the engine finds its blocks again; never shared by two engines."""
    if not args.kv_offload_dir:
        return args
    root = os.path.abspath(args.kv_offload_dir)
    return dataclasses.replace(args, kv_offload_dir=os.path.join(root, f"{role}-{i}"))


def kv_events_flags(value: str | dict | None, rank: int) -> list[str]:
    """--kv-events-config for the `rank`-th engine on the host: the endpoints' ports offset
    by `rank` (services/common/kv_events.py `offset_endpoint_port`); [] without a config.

    Raises:
        ValueError: a bad config (one line).
    """
    config = KVEventsConfig.from_value(value)
    if config is None:
        return []
    config = dataclasses.replace(
        config, endpoint=offset_endpoint_port(config.endpoint, rank),
        replay_endpoint=offset_endpoint_port(config.replay_endpoint, rank))
    return ["--kv-events-config", config.to_json()]


def _ports(base: int | None, n: int, picked: Iterator[int]) -> list[int]:
    return [base + i for i in range(n)] if base is not None else [next(picked) for _ in range(n)]


def build_plan(config: UpConfig, model_path: str, served_model_name: str,
               python: str = sys.executable, first_engine_rank: int = 0) -> Plan:
    """The children for `config`; internal ports not given are picked free now.
    `first_engine_rank`: the KV events port offset of the first engine (engines of other
    models on the host come first)."""
    # NOTE: a pooling model (--runner pooling / --convert embed) runs on the prefill
    # instances only: no decode replica, the gateway serves the pooling routes.
    pooling = resolve_runner(config.engine_args.runner, config.engine_args.convert) == "pooling"
    n_p, n_d = config.num_prefill, 0 if pooling else config.num_decode
    wanted = sum(b is None for b in (config.prefill_port, config.prefill_metrics_port)) * n_p
    wanted += sum(b is None for b in (config.decode_port, config.decode_metrics_port)) * n_d
    wanted += int(config.redis_url is None and config.redis_port is None)
    picked = iter(free_ports(wanted))
    children: list[ChildSpec] = []
    if config.redis_url is None:
        redis_port = config.redis_port if config.redis_port is not None else next(picked)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        children.append(ChildSpec(
            "redis", ("redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                      "--save", "", "--appendonly", "no", "--loglevel", "notice"),
            Probe("redis", f"127.0.0.1:{redis_port}"), stage=2, ports=(redis_port,)))
    else:
        redis_url = config.redis_url
    share_path = ""
    # NOTE: the core share sizes CPU compute (each step's OpenMP pool, a prefill engine
    # pausing for a shorter one on the host): on CUDA the GPU computes, so the engines there
    # get the static split of --cpu-split instead (disjoint cores for their host threads).
    if config.cpu_share and config.engine_args.device != "cuda" \
            and config.prefill_cpu_cores is None and config.decode_cpu_cores is None:
        # Every engine on every core; the core board divides them step by step.
        cores = tuple(config.cpu_cores or available_cores())
        split = CoreSplit([cores] * n_p, [cores] * n_d)
        share_path = config.core_share_path or default_board_path()
    elif pooling:
        split = CoreSplit(distribute(config.prefill_cpu_cores or config.cpu_cores
                                     or available_cores(), n_p), [])
    elif config.cpu_split:
        split = split_cores(config.cpu_cores or available_cores(), n_p, n_d,
                            config.prefill_cpu_cores, config.decode_cpu_cores)
    else:
        split = split_cores((), n_p, n_d, config.prefill_cpu_cores or (),
                            config.decode_cpu_cores or ())
    args = dataclasses.replace(config.engine_args, model=model_path,
                               served_model_name=served_model_name, cpu_cores="",
                               core_share=share_path, kv_events_config=None)
    rank = first_engine_rank
    grace = max(1.0, config.shutdown_timeout - 5.0)
    addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
    # NOTE: secrets go by environment, not argv, where `ps` would show them.
    token_env = {"PDSERVE_INTERNAL_TOKEN": config.internal_token} if config.internal_token \
        else {}
    for role, n, base, metrics_base, cores in (
            ("prefill", n_p, config.prefill_port, config.prefill_metrics_port, split.prefill),
            ("decode", n_d, config.decode_port, config.decode_metrics_port, split.decode)):
        for i, (port, metrics_port) in enumerate(zip(_ports(base, n, picked),
                                                     _ports(metrics_base, n, picked))):
            address = f"127.0.0.1:{port}"
            addresses[role].append(address)
            argv = [python, "-m", "pdserve.services.cli", "--log-level", config.log_level,
                    "serve", role,
                    "--host", "127.0.0.1", "--port", str(port),
                    "--metrics-port", str(metrics_port), "--redis-url", redis_url,
                    "--grace-period", f"{grace:g}", *engine_flags(_tier_of(args, role, i)),
                    *kv_events_flags(config.engine_args.kv_events_config, rank)]
            rank += 1
            if cores[i]:
                argv += ["--cpu-cores", format_cores(cores[i])]
            if config.lora_modules:
                argv += ["--lora-modules", *config.lora_modules]
            children.append(ChildSpec(f"{role}-{i}", tuple(argv), Probe("grpc", address),
                                      stage=1, ports=(port, metrics_port), cores=cores[i],
                                      env=token_env))
    gateway_url = f"http://{connect_host(config.host)}:{config.port}"
    argv = [python, "-m", "pdserve.services.cli", "serve", "gateway", "--host", config.host,
            "--port", str(config.port), "--model", model_path,
            "--served-model-name", served_model_name, "--redis-url", redis_url,
            "--prefill-url", ",".join(addresses["prefill"]),
            "--decode-url", ",".join(addresses["decode"]),
            "--block-size", str(args.block_size), "--log-level", config.log_level.lower(),
            "--grace-period", f"{grace:g}"]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if pooling:
        argv += ["--runner", "pooling"]
    argv += list(config.gateway_flags)
    env = {"PDSERVE_API_KEY": config.api_key} if config.api_key else {}
    if config.admin_api_key:
        env["PDSERVE_ADMIN_API_KEY"] = config.admin_api_key
    env.update(token_env)
    children.append(ChildSpec("gateway", tuple(argv), Probe("http", gateway_url + "/health"),
                              stage=0, ports=(config.port,), env=env))
    return Plan(tuple(children), gateway_url, redis_url, served_model_name)
