"""ServiceConfig: the prefill and decode services' own flags (beside EngineArgs), frozen once.

Precedence: command-line flag > PDSERVE_<FLAG> environment variable > default.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from typing import Literal

from pdserve.services.common.advertise import advertise_address, is_loopback
from pdserve.shared.config import DEFAULT_MAX_CHUNK_BYTES, MAX_GRPC_MESSAGE_BYTES
from pdserve.shared.lora.request import LoRARequest

Role = Literal["prefill", "decode"]
DEFAULT_PORTS = {"prefill": (50051, 9051), "decode": (50052, 9052)}


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    role: Role
    host: str = "127.0.0.1"
    """Bind address of the gRPC and metrics servers: loopback unless told otherwise
    (`--host 0.0.0.0` for every interface, e.g. in containers)."""
    port: int = 0
    """gRPC port; 0 picks a free one (tests)."""
    advertise_address: str = ""
    """HOST[:PORT] others reach this instance at (KV handles, the registry; a bare HOST gets
    the bound port); "" derives it: the bind host, or with a wildcard bind this host's address
    on its route to Redis (services/common/advertise.py)."""
    instance_id: str = ""
    """Unique name in the registry; "" derives `{role}-{hostname}-{port}`."""
    metrics_port: int | None = None
    """Prometheus endpoint port; None disables it, 0 picks a free one."""
    redis_url: str | None = None
    """The prefix index; None runs without it (no registration, no affinity)."""
    heartbeat_interval: float = 3.0
    """Seconds between registrations (load figures, republish after a Redis restart)."""
    registration_ttl: float = 10.0
    """Seconds a registration outlives the last heartbeat."""
    publish_interval: float = 0.25
    """Seconds between drains of the cache events (published to Redis) and metric polls."""
    redis_max_backoff: float = 5.0
    """Longest wait between attempts to reach an unreachable Redis, seconds."""
    grace_period: float = 10.0
    """SIGTERM: seconds in-flight requests get to finish (health NOT_SERVING meanwhile)."""
    max_message_bytes: int = MAX_GRPC_MESSAGE_BYTES
    """gRPC max send/receive message size, both ends (shared.config.MAX_GRPC_MESSAGE_BYTES)."""
    internal_token: str | None = field(default=None, repr=False)
    """If set, every PrefillService / DecodeService call must carry the gRPC metadata
    `authorization: Bearer <token>` (UNAUTHENTICATED otherwise); grpc.health stays open.
    The decode service sends it on its FetchKV / ReleaseKV calls to prefill instances."""
    allow_insecure_internal: bool = False
    """Start without `internal_token` on a non-loopback `host` (anyone who reaches the port
    may then call Prefill, FetchKV, Abort ...); refused otherwise."""
    stall_timeout: float = 30.0
    """Readiness: seconds the engine may go without completing a step while it has work
    queued before health turns NOT_SERVING (back to SERVING when steps resume); 0 disables."""
    test_stall_file: str = ""
    """Test hook (env PDSERVE_TEST_STALL_FILE only): while this file exists the engine thread
    sleeps before each step that has requests to run. Empty: no hook."""
    rpc_timeout: float = 5.0
    """Deadline of small calls to other instances (ReleaseKV), seconds."""
    kv_pin_ttl: float = 30.0
    """Prefill: seconds a KV handle stays pinned when nobody fetches or releases it."""
    kv_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    """Prefill: most KV payload bytes per streamed KVChunk."""
    max_waiting_requests: int = 256
    """Decode: requests queued for KV blocks or in the engine's waiting queue before
    Generate answers RESOURCE_EXHAUSTED."""
    kv_transfer_timeout: float = 60.0
    """Decode: deadline of one FetchKV stream, seconds."""
    lora_modules: tuple[LoRARequest, ...] = ()
    """LoRA adapters loaded before the instance serves (`--lora-modules`, vLLM's flag;
    services/common/lora.py); needs the engine's --enable-lora."""

    @property
    def stall_check_interval(self) -> float:
        """Seconds between the stall watchdog's looks at the engine."""
        return min(1.0, self.stall_timeout / 5)

    def grpc_options(self) -> list[tuple[str, int]]:
        """Explicit message limits, the same on servers and channels."""
        return [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes)]

    def resolve_address(self, bound_port: int) -> str:
        """host:port others reach this instance at (services/common/advertise.py)."""
        return advertise_address(self.advertise_address, self.host, bound_port, self.redis_url)

    def resolve_instance_id(self, bound_port: int) -> str:
        return self.instance_id or f"{self.role}-{socket.gethostname()}-{bound_port}"


def _env(name: str, default):
    return os.environ.get("PDSERVE_" + name.upper(), default)


def add_service_args(parser: argparse.ArgumentParser, role: Role) -> argparse.ArgumentParser:
    port, metrics_port = DEFAULT_PORTS[role]
    d = ServiceConfig(role)
    g = parser.add_argument_group(f"{role} service")

    def number(name: str, kind: type, help: str | None = None, default=None) -> None:
        """--<name> of type `kind`; default PDSERVE_<NAME>, else `default` or ServiceConfig's."""
        default = getattr(d, name) if default is None else default
        g.add_argument("--" + name.replace("_", "-"), type=kind,
                       default=kind(_env(name, default)), help=help)

    g.add_argument("--host", default=_env("host", d.host))
    number("port", int, default=port)
    g.add_argument("--advertise-address", default=_env("advertise_address", ""),
                   help="HOST[:PORT] other hosts reach this instance at (default: the --host "
                        "address; with 0.0.0.0 this host's address on its route to Redis)")
    g.add_argument("--instance-id", default=_env("instance_id", ""))
    number("metrics_port", int, "Prometheus endpoint port (-1 disables it)", metrics_port)
    g.add_argument("--redis-url", default=_env("redis_url", None),
                   help="the prefix index, e.g. redis://localhost:6379/0 (optional)")
    number("heartbeat_interval", float)
    number("registration_ttl", float)
    number("grace_period", float)
    number("max_message_bytes", int,
           "gRPC max send/receive message size of the server and its channels")
    g.add_argument("--internal-token", default=_env("internal_token", None),
                   help="shared secret every PrefillService/DecodeService call must carry as "
                        "`authorization: Bearer <token>` metadata (or PDSERVE_INTERNAL_TOKEN)")
    g.add_argument("--allow-insecure-internal", action="store_true",
                   default=_env("allow_insecure_internal", "") not in ("", "0", "false"),
                   help="serve a non-loopback --host without --internal-token (refused "
                        "otherwise)")
    number("stall_timeout", float, "seconds without a completed engine step, with work "
           "queued, before health reports NOT_SERVING (0 disables)")
    g.add_argument("--test-stall-file", default=_env("test_stall_file", ""),
                   help=argparse.SUPPRESS)
    g.add_argument("--lora-modules", nargs="+", action="extend",
                   default=_env("lora_modules", "").split(),
                   help="LoRA adapters to load before serving, as vLLM: name=path, or JSON "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (repeatable; '
                        "needs --enable-lora)")
    if role == "prefill":
        number("kv_pin_ttl", float, "seconds an unfetched KV handle stays pinned")
        number("kv_chunk_bytes", int)
    else:
        number("max_waiting_requests", int)
        number("kv_transfer_timeout", float)
    return parser


def config_from_args(ns: argparse.Namespace, role: Role) -> ServiceConfig:
    """Validate and freeze. Raises ValueError naming the flag."""
    fields = {name: getattr(ns, name) for name in ServiceConfig.__dataclass_fields__
              if name != "role" and hasattr(ns, name)}
    if "lora_modules" in fields:
        from pdserve.services.common.lora_modules import check_adapter_dir, parse_lora_modules

        fields["lora_modules"] = parse_lora_modules(fields["lora_modules"])
        for lora in fields["lora_modules"]:
            check_adapter_dir(lora)
        if fields["lora_modules"] and not getattr(ns, "enable_lora", False):
            raise ValueError("--lora-modules needs --enable-lora")
    if fields.get("metrics_port") is not None and fields["metrics_port"] < 0:
        fields["metrics_port"] = None
    if "internal_token" in fields:
        fields["internal_token"] = fields["internal_token"] or None
    config = ServiceConfig(role=role, **fields)
    for name in ("heartbeat_interval", "registration_ttl", "kv_pin_ttl", "kv_transfer_timeout"):
        if getattr(config, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if config.registration_ttl <= config.heartbeat_interval:
        raise ValueError("--registration-ttl must exceed --heartbeat-interval")
    if config.stall_timeout < 0:
        raise ValueError("--stall-timeout must be >= 0")
    t = config.internal_token
    if t is not None and not (t.isascii() and t.isprintable() and t.strip() == t):
        raise ValueError("--internal-token must be printable ASCII (it travels as gRPC "
                         "metadata)")
    if not (config.internal_token or config.allow_insecure_internal
            or is_loopback(config.host)):
        raise ValueError(f"--host {config.host} is reachable from other machines and no "
                         "--internal-token (PDSERVE_INTERNAL_TOKEN) is set: give one, bind "
                         "127.0.0.1, or pass --allow-insecure-internal")
    if config.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be >= 0")
    if not 1 << 16 <= config.kv_chunk_bytes <= config.max_message_bytes - (64 << 10):
        raise ValueError("--kv-chunk-bytes must be in [64KiB, --max-message-bytes - 64KiB]")
    return config
