"""`pdserve serve {prefill,decode,gateway}` and `pdserve healthcheck` (hooked by shared.cli).

    pdserve serve prefill --port 50051 --metrics-port 9051 --redis-url redis://127.0.0.1:6379 \\
        --cpu-cores 0 --kv-cache-memory 2GiB
    pdserve serve decode  --port 50052 --metrics-port 9052 --redis-url redis://127.0.0.1:6379 \\
        --cpu-cores 1
    pdserve healthcheck --address 127.0.0.1:50051        # exit 0 only when SERVING

The services bind 127.0.0.1 unless given `--host 0.0.0.0`. SERVING means ready: loaded, not
draining, and the engine not stalled (`--stall-timeout`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

logger = logging.getLogger(__name__)


def add_service_commands(sub) -> None:
    from services.common.config import add_service_args
    from services.gateway.config import add_cli_args as add_gateway_args
    from shared.engine_args import EngineArgs

    serve = sub.add_parser("serve", help="run one service of the split engine")
    roles = serve.add_subparsers(dest="serve_role", required=True)
    for role in ("prefill", "decode"):
        p = roles.add_parser(role, help=f"the {role} gRPC service")
        add_service_args(p, role)  # type: ignore[arg-type]
        EngineArgs.add_cli_args(p)
        p.set_defaults(func=_cmd_serve)
    p = roles.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    add_gateway_args(p)
    p.set_defaults(func=_cmd_serve_gateway)
    p = sub.add_parser("healthcheck", help="exit 0 when a service answers SERVING")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--address", help="host:port of a prefill or decode gRPC server")
    target.add_argument("--url", help="an HTTP health URL (the gateway's /health)")
    p.add_argument("--service", default="", help="gRPC health service name ('' = server)")
    p.add_argument("--timeout", type=float, default=3.0)
    p.set_defaults(func=_cmd_healthcheck)


def _cmd_serve(ns: argparse.Namespace) -> int:
    from services.common.config import config_from_args
    from services.common.launch import build_runtime
    from shared.config import ParallelConfig
    from shared.engine.engine_core import apply_cpu_placement
    from shared.engine_args import EngineArgs, parse_cores

    role = ns.serve_role
    if _crashes_once(role):
        return 3
    try:
        config = config_from_args(ns, role)
        engine_args = EngineArgs.from_cli_args(ns)
        if role == "decode":
            engine_args.create_speculative_config()  # a bad key: one line and exit 2
        # Bind before any thread starts (gRPC's, the engine's): threads inherit the mask.
        # The event loop's own torch work (KV chunk copies) runs on one thread: only the
        # engine thread owns a multi-threaded OpenMP pool (see apply_cpu_placement).
        apply_cpu_placement(ParallelConfig(cpu_cores=parse_cores(engine_args.cpu_cores),
                                           num_threads=engine_args.num_threads), threads=1)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    logger.info("%s service config: %s", role, config)
    runtime = build_runtime(config, engine_args)
    return asyncio.run(runtime.serve_forever())


def _crashes_once(role: str) -> bool:
    """Test hook (env PDSERVE_TEST_CRASH_ONCE=ROLE:MARKER only; off by default): the first
    start of a ROLE service that finds no MARKER file creates it and exits 3 before it is
    ready, so a launcher's restart of a child that never came up can be tested."""
    import os

    wanted, _, marker = os.environ.get("PDSERVE_TEST_CRASH_ONCE", "").partition(":")
    if wanted != role or not marker:
        return False
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    print(f"test hook PDSERVE_TEST_CRASH_ONCE: this {role} exits on its first start",
          flush=True)
    return True


def _cmd_serve_gateway(ns: argparse.Namespace) -> int:
    from services.gateway.__main__ import run

    return run(ns)


def _cmd_healthcheck(ns: argparse.Namespace) -> int:
    if ns.url:
        import urllib.request

        try:
            with urllib.request.urlopen(ns.url, timeout=ns.timeout) as resp:
                ok = resp.status == 200
        except OSError as e:
            print(f"{ns.url}: {e}")
            return 1
        print(f"{ns.url}: {'ok' if ok else 'unhealthy'}")
        return 0 if ok else 1

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shared.config import MAX_GRPC_MESSAGE_BYTES

    # NOTE: grpc.health needs no internal token: probes work on a token-protected service.
    options = [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES)]
    with grpc.insecure_channel(ns.address, options=options) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=ns.service), timeout=ns.timeout)
        except grpc.RpcError as e:
            print(f"{ns.address}: {e.code().name}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{ns.address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1
