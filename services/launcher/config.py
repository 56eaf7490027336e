"""UpConfig: the flags of `pdserve up` (vLLM spellings where vLLM has the flag), frozen once.

The engine flags (`--model`, `--max-num-seqs`, `--max-model-len`, `--block-size`,
`--enable-prefix-caching`, `--kv-cache-memory`, ...) are EngineArgs' own, passed through to
every prefill and decode replica; `--cpu-cores` is the set of cores the launcher splits
between them. Internal ports (Redis, gRPC, metrics) are picked free unless given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field

from pdserve.services.common.lora_modules import check_adapter_dir, parse_lora_modules
from pdserve.services.gateway.config import add_compat_args
from pdserve.services.gateway.tool_parsers import check_tool_call_parser
from pdserve.services.launcher.models import add_repeated_model_arg
from pdserve.shared.engine_args import EngineArgs, parse_cores
from pdserve.shared.pooling_params import PoolerConfig, resolve_runner


@dataclass(frozen=True, slots=True)
class UpConfig:
    engine_args: EngineArgs
    """Engine flags, the same for every prefill and decode replica (cpu_cores aside)."""
    host: str = "127.0.0.1"
    """The gateway's bind address; internal services always bind 127.0.0.1."""
    port: int = 8000
    """The gateway's port, the only one meant for clients."""
    api_key: str | None = None
    admin_api_key: str | None = field(default=None, repr=False)
    """The operator's key for the gateway's /debug/* routes (services/gateway/admin.py)."""
    gateway_flags: tuple[str, ...] = ()
    """Extra `pdserve serve gateway` flags (queue bounds, retries, local-prefill threshold)."""
    internal_token: str | None = field(default=None, repr=False)
    """Shared secret the prefill and decode services require and the gateway (and decode,
    to prefill) sends; None here: `pdserve up` generates a random one per launch."""
    num_prefill: int = 1
    num_decode: int = 1
    cpu_cores: tuple[int, ...] = ()
    """Cores to split between the engine processes; () = this process's affinity."""
    prefill_cpu_cores: tuple[int, ...] | None = None
    """Override: the prefill replicas' cores (split among them); None = derived."""
    decode_cpu_cores: tuple[int, ...] | None = None
    cpu_split: bool = True
    """Without the core share: True binds prefill and decode to disjoint cores; False: no
    binding, every engine process may use every core."""
    cpu_share: bool = True
    """Every engine may use every core of `cpu_cores` and takes, each step, its share among
    the engines busy now (`shared/engine/core_share.py`); off, on `--device cuda`, or with
    a per-role core override, the static split (`cpu_split`) applies."""
    core_share_path: str = ""
    """The host's core board (default: `default_board_path()`, one per host)."""
    prefill_port: int | None = None
    """First prefill gRPC port (replica i gets +i); None = free ports."""
    decode_port: int | None = None
    prefill_metrics_port: int | None = None
    decode_metrics_port: int | None = None
    redis_port: int | None = None
    redis_url: str | None = None
    """Use this Redis instead of starting one."""
    shutdown_timeout: float = 30.0
    """Seconds from Ctrl-C / SIGTERM until whatever still runs is killed."""
    startup_timeout: float = 600.0
    """Seconds every health check gets to pass (the model loads within it)."""
    log_level: str = "INFO"
    restart_engines: bool = True
    """Start a prefill or decode replica or the Redis started here that died again (with a
    backoff); False: any child's death stops everything."""
    lora_modules: tuple[str, ...] = ()
    """`--lora-modules` values, passed as given to every prefill and decode replica (each
    loads them before it serves; the gateway learns them from the registry)."""
    extra_models: tuple[str, ...] = ()
    """The models of the second and later `--model` flags, each served by its own
    --num-prefill / --num-decode replicas behind the one gateway (launcher/models.py)."""


_PORT_FLAGS = {
    "prefill-port": "first prefill gRPC port, replica i gets +i",
    "decode-port": "first decode gRPC port, replica i gets +i",
    "prefill-metrics-port": "first prefill Prometheus port, replica i gets +i",
    "decode-metrics-port": "first decode Prometheus port, replica i gets +i",
    "redis-port": "port of the Redis started here",
}


def _cores(text: str | None) -> tuple[int, ...] | None:
    return None if text in (None, "") else parse_cores(text)


_GATEWAY_FLAGS = (
    ("max-num-queued-requests", int, "waiting engine requests before 429"),
    ("max-queued-tokens", int, "waiting prompt + max_tokens tokens before 429"),
    ("max-request-retries", int, "failovers one engine request may use"),
    ("max-stream-backlog", int, "bytes a stream may have waiting for a slow client"),
    ("socket-send-buffer", int, "SO_SNDBUF of the gateway's client connections, bytes"),
    ("stream-pause-bytes", int, "bytes a client may be behind before its requests pause"),
    ("stream-resume-bytes", int, "bytes behind at which a paused stream resumes"),
    ("max-stream-pause-s", float, "seconds a stream may stay paused before it is cut"),
    ("local-prefill-threshold", int,
     "prompts with fewer uncached tokens are prefilled on the decode instance"),
    ("max-prefill-queue-size", int,
     "prefills in flight at a prefill instance before a prompt is prefilled on its decode "
     "instance"),
    ("responses-ttl", float, "seconds a stored /v1/responses response lives in Redis"),
)
UP_LOCAL_PREFILL_THRESHOLD = 256
"""`pdserve up`'s default --local-prefill-threshold when the prefill engines have cores of
their own (`--no-cpu-share`, per-role cores, or CUDA): conditional disaggregation, as NVIDIA
Dynamo's `max_local_prefill_length`: a short prompt costs more to ship than to prefill in
the decode batch, and every prompt with this many uncached tokens still goes through the
prefill service and a KV transfer."""


UP_UNIFIED_LOCAL_PREFILL_THRESHOLD = 1_000_000_000
"""`pdserve up`'s default --local-prefill-threshold when its engines share the host's cores
(the core share, the default on CPU) or latency targets are given (--slo-ttft-ms,
--slo-tpot-ms): every prompt is prefilled on the decode engine. On shared cores the split
buys no compute and costs a transfer and a second engine competing for the same cores;
measured beside the split on this 2-core host (docs/benchmarks.md, "Goodput under SLOs"):
under steady (Poisson) load the unified path met the chat SLO for 0.84 of requests against
0.23; in bursts, mixed64 1.06x the output tok/s with TTFT p50 0.40x, prefix32 wall 0.69x.
The prefill service still runs (an explicit --local-prefill-threshold, the load rule
--max-prefill-queue-size, or a failover uses it)."""


def shares_cores(ns: argparse.Namespace) -> bool:
    """Whether `pdserve up` runs its engines on one core share (every engine on every core):
    on CPU, without --no-cpu-share or a per-role core override."""
    return bool(getattr(ns, "cpu_share", True)) and getattr(ns, "device", "cpu") != "cuda" \
        and getattr(ns, "prefill_cpu_cores", None) is None \
        and getattr(ns, "decode_cpu_cores", None) is None


_COMPAT_FLAGS = ("tokenizer", "chat-template", "metrics-compat", "tool-call-parser",
                 "generation-config")
_COMPAT_LISTS = ("allowed-origins", "allowed-methods", "allowed-headers")
_COMPAT_SWITCHES = ("allow-credentials", "protect-metrics", "enable-auto-tool-choice")


def _gateway_flags(ns: argparse.Namespace) -> tuple[str, ...]:
    out: list[str] = []
    for flag in _COMPAT_FLAGS:
        value = getattr(ns, flag.replace("-", "_"))
        if value:
            out += [f"--{flag}", str(value)]
    for flag in _COMPAT_LISTS:
        value = getattr(ns, flag.replace("-", "_"))
        if list(value) != ["*"]:
            out += [f"--{flag}", json.dumps(list(value))]
    out += [f"--{flag}" for flag in _COMPAT_SWITCHES if getattr(ns, flag.replace("-", "_"))]
    for flag, _, _ in _GATEWAY_FLAGS:
        value = getattr(ns, flag.replace("-", "_"))
        if flag == "local-prefill-threshold" and value is None:
            value = (UP_UNIFIED_LOCAL_PREFILL_THRESHOLD
                     if getattr(ns, "slo_ttft_ms", 0) or getattr(ns, "slo_tpot_ms", 0)
                     or shares_cores(ns) else UP_LOCAL_PREFILL_THRESHOLD)
        if value is not None:
            out += [f"--{flag}", str(value)]
    return tuple(out)


def add_up_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("gateway")
    g.add_argument("--host", default="127.0.0.1",
                   help="gateway bind address (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="gateway port")
    g.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` (or set PDSERVE_API_KEY)")
    g.add_argument("--admin-api-key", default=os.environ.get("PDSERVE_ADMIN_API_KEY"),
                   help="the operator's key for /debug/* (or set PDSERVE_ADMIN_API_KEY)")
    for flag, kind, text in _GATEWAY_FLAGS:
        g.add_argument(f"--{flag}", type=kind, default=None,
                       help=text + " (passed to the gateway; default: the gateway's)")
    add_compat_args(parser)
    EngineArgs.add_cli_args(parser)
    add_repeated_model_arg(parser)
    g = parser.add_argument_group("launcher")
    g.add_argument("--internal-token", default=os.environ.get("PDSERVE_INTERNAL_TOKEN"),
                   help="shared secret for the gRPC calls between the gateway, prefill and "
                        "decode (or set PDSERVE_INTERNAL_TOKEN); default: a random one per launch")
    g.add_argument("--lora-modules", nargs="+", action="extend", default=[],
                   help="LoRA adapters every replica loads before serving, as vLLM: "
                        "name=path or a JSON object (needs --enable-lora)")
    g.add_argument("--num-prefill", type=int, default=1, help="prefill replicas")
    g.add_argument("--num-decode", type=int, default=1, help="decode replicas")
    g.add_argument("--prefill-cpu-cores", default=None,
                   help="cores for the prefill replicas, e.g. 0-3 (default: a share of "
                        "--cpu-cores)")
    g.add_argument("--decode-cpu-cores", default=None, help="cores for the decode replicas")
    g.add_argument("--cpu-share", action=argparse.BooleanOptionalAction, default=True,
                   help="the engines share the cores: each step an engine takes its share "
                        "of them among the engines busy now (off, and on --device cuda: "
                        "the static --cpu-split)")
    g.add_argument("--cpu-split", action=argparse.BooleanOptionalAction, default=True,
                   help="with --no-cpu-share: bind prefill and decode to disjoint cores")
    for name, text in _PORT_FLAGS.items():
        g.add_argument(f"--{name}", type=int, default=None, help=text + " (default: free)")
    g.add_argument("--redis-url", default=None,
                   help="use this Redis (e.g. redis://host:6379/0) instead of starting one")
    g.add_argument("--restart-engines", action=argparse.BooleanOptionalAction, default=True,
                   help="start a prefill or decode replica (or the Redis started here) that "
                        "died again, after a backoff of 1, 2, 4 ... 30 s (off: any child's "
                        "death stops everything)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to drain on Ctrl-C / SIGTERM before killing what is left")
    g.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds for every health check to pass")
    return parser


def config_from_args(ns: argparse.Namespace) -> UpConfig:
    """Validate and freeze. Raises ValueError naming the flag."""
    engine_args = EngineArgs.from_cli_args(ns)
    same_names = {name: getattr(ns, name) for name in UpConfig.__dataclass_fields__
                  if hasattr(ns, name)}
    config = UpConfig(**{
        **same_names, "engine_args": dataclasses.replace(engine_args, cpu_cores="", core_share=""),
        "api_key": ns.api_key or None, "admin_api_key": ns.admin_api_key or None,
        "gateway_flags": _gateway_flags(ns), "internal_token": ns.internal_token or None,
        "cpu_cores": parse_cores(engine_args.cpu_cores),
        "prefill_cpu_cores": _cores(ns.prefill_cpu_cores),
        "decode_cpu_cores": _cores(ns.decode_cpu_cores), "core_share_path": engine_args.core_share,
        "redis_url": ns.redis_url or None, "log_level": str(ns.log_level).upper(),
        "lora_modules": tuple(ns.lora_modules),
        "extra_models": tuple((getattr(ns, "models", None) or [])[1:])})
    for name in ("num_prefill", "num_decode"):
        if getattr(config, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("port", *(flag.replace("-", "_") for flag in _PORT_FLAGS)):
        value = getattr(config, name)
        if value is not None and not 0 < value < 65536:
            raise ValueError(f"--{name.replace('_', '-')} must be in 1..65535, got {value}")
    if config.shutdown_timeout <= 0 or config.startup_timeout <= 0:
        raise ValueError("--shutdown-timeout and --startup-timeout must be > 0")
    check_tool_call_parser(ns.tool_call_parser)  # before any service starts
    engine_args.create_lora_config()
    for lora in parse_lora_modules(config.lora_modules):  # a bad one: before any start
        check_adapter_dir(lora)
    if config.lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if resolve_runner(engine_args.runner, engine_args.convert) == "pooling":  # no decode
        PoolerConfig.from_flags(engine_args.pooler_config, engine_args.override_pooler_config)
    return config
