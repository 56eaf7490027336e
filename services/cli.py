"""The `pdserve` command: convert, generate, serve {prefill,decode,gateway}, up, healthcheck.

As `vllm serve MODEL`: `pdserve serve MODEL [flags]` (a model, not a role, after `serve`)
runs the whole stack, i.e. `pdserve up --model MODEL [flags]`. Global flags (`--log-level`)
work before or after the subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import sys

logger = logging.getLogger(__name__)


def _cmd_convert(ns: argparse.Namespace) -> int:
    from pdserve.shared.models.convert import resolve_model_path

    try:
        print(resolve_model_path(ns.model))
    except ValueError as e:  # a .gguf pdserve does not serve: one line, as serve / up
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_generate(ns: argparse.Namespace) -> int:
    from pdserve.shared.engine_args import EngineArgs
    from pdserve.shared.llm import LLM
    from pdserve.shared.sampling_params import SamplingParams

    args = EngineArgs.from_cli_args(ns)
    try:
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                                seed=ns.seed, top_p=ns.top_p, top_k=ns.top_k,
                                ignore_eos=ns.ignore_eos)
        llm = LLM(**{f: getattr(args, f) for f in vars(args)})
        if ns.messages_json is not None:
            messages = json.loads(ns.messages_json)
            out = llm.chat(messages, params)[0]
        elif ns.chat:
            out = llm.chat([{"role": "user", "content": ns.prompt}], params)[0]
        else:
            out = llm.generate(ns.prompt, params)[0]
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = out.outputs[0]
    if ns.json:
        print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "token_ids": c.token_ids,
                          "text": c.text, "finish_reason": c.finish_reason}))
    else:
        print(c.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pdserve.shared.engine_args import EngineArgs

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert the model to a local safetensors cache, once")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("generate", help="run the engine in-process on one prompt")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--messages-json", help='e.g. [{"role": "user", "content": "Hi"}]')
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print token_ids, text, finish_reason")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_cmd_generate)
    _add_service_commands(sub)
    _add_up_command(sub)
    return parser


def _add_service_commands(sub) -> None:
    """`pdserve serve {prefill,decode,gateway}` and `pdserve healthcheck`:

        pdserve serve prefill --port 50051 --metrics-port 9051 --redis-url redis://127.0.0.1:6379 \\
            --cpu-cores 0 --kv-cache-memory 2GiB
        pdserve serve decode  --port 50052 --metrics-port 9052 --redis-url redis://127.0.0.1:6379 \\
            --cpu-cores 1
        pdserve healthcheck --address 127.0.0.1:50051        # exit 0 only when SERVING

    The services bind 127.0.0.1 unless given `--host 0.0.0.0`. SERVING means ready: loaded,
    not draining, and the engine not stalled (`--stall-timeout`). Each command imports what
    it runs only when it runs.
    """
    from pdserve.services.common.config import add_service_args
    from pdserve.services.gateway.config import add_cli_args as add_gateway_args
    from pdserve.shared.engine_args import EngineArgs

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
    from pdserve.services.common.config import config_from_args
    from pdserve.services.common.kv_events import KVEventsConfig
    from pdserve.services.common.launch import build_runtime, engine_loader
    from pdserve.shared.config import ParallelConfig
    from pdserve.shared.engine.engine_core import apply_cpu_placement
    from pdserve.shared.engine_args import EngineArgs, parse_cores
    from pdserve.shared.models.architectures import check_model_dir
    from pdserve.shared.pooling_params import PoolerConfig, resolve_runner

    role = ns.serve_role
    if _crashes_once(role):
        return 3
    try:
        config = config_from_args(ns, role)
        engine_args = EngineArgs.from_cli_args(ns)
        if role == "decode":
            engine_args.create_speculative_config()  # a bad key: one line and exit 2
        engine_args.create_lora_config()  # --max-loras ... out of range: exit 2
        KVEventsConfig.from_value(engine_args.kv_events_config)  # a bad key: exit 2
        if resolve_runner(engine_args.runner, engine_args.convert) == "pooling":
            if role == "decode":
                raise ValueError("--runner pooling: a pooling model runs on prefill instances "
                                 "only (no decode); start `pdserve serve prefill`")
            PoolerConfig.from_flags(engine_args.pooler_config,
                                    engine_args.override_pooler_config)  # a bad key: exit 2
        check_model_dir(engine_args.model, engine_args.max_model_len)  # before listening
        # Bind before any thread starts (gRPC's, the engine's): threads inherit the mask.
        # The event loop's own torch work (KV chunk copies) runs on one thread: only the
        # engine thread owns a multi-threaded OpenMP pool (see apply_cpu_placement).
        apply_cpu_placement(ParallelConfig(cpu_cores=parse_cores(engine_args.cpu_cores),
                                           num_threads=engine_args.num_threads), threads=1)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    logger.info("%s service config: %s", role, config)
    load = engine_loader(engine_args, role)

    def load_and_freeze():
        # Start-up's objects (the model, the modules, the tokenizer) live as long as the
        # process: out of the collector's generations, so full collections while serving
        # walk only what serving allocates (vLLM's engine process does the same). Not in
        # engine_loader: in-process engines of tests are dropped, and frozen they would be
        # collected only by reference counts.
        loaded = load()
        gc.collect()
        gc.freeze()
        return loaded
    runtime = build_runtime(config, engine_args, load_engine=load_and_freeze)
    return asyncio.run(runtime.serve_forever())


def _crashes_once(role: str) -> bool:
    """Test hook (env PDSERVE_TEST_CRASH_ONCE=ROLE:MARKER only; off by default): the first
    start of a ROLE service that finds no MARKER file creates it and exits 3 before it is
    ready, so a launcher's restart of a child that never came up can be tested."""
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
    from pdserve.services.gateway.__main__ import run

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

    from pdserve.services.common.auth import internal_sync_channel

    # NOTE: grpc.health needs no internal token: probes work on a token-protected service.
    with internal_sync_channel(ns.address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=ns.service), timeout=ns.timeout)
        except grpc.RpcError as e:
            print(f"{ns.address}: {e.code().name}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{ns.address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def _add_up_command(sub) -> None:
    """`pdserve up`: the local launcher (services/launcher/up.py does the work)."""
    from pdserve.services.launcher.config import add_up_args

    p = sub.add_parser(
        "up", help="run Redis, prefill, decode and the gateway locally until Ctrl-C",
        description="Start Redis, the prefill and decode services and the OpenAI-compatible "
                    "gateway as child processes, wait for their health checks, print the "
                    "URL; Ctrl-C or SIGTERM drains and stops them all.")
    add_up_args(p)
    p.set_defaults(func=_cmd_up)


def _cmd_up(ns: argparse.Namespace) -> int:
    from pdserve.services.launcher.up import main

    return main(ns)


_ROLES = ("prefill", "decode", "gateway")


def normalize_argv(argv: list[str]) -> tuple[list[str], str | None]:
    """(argv with `serve MODEL` rewritten to `up --model MODEL` and every `--log-level V`
    moved in front of the subcommand, the --log-level given (last wins) or None)."""
    rest, log_level, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--log-level" and i + 1 < len(argv):
            log_level, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--log-level="):
            log_level = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if rest[:1] == ["serve"] and len(rest) > 1 and rest[1] not in (*_ROLES, "-h", "--help"):
        rest = ["up", *(["--model", rest[1], *rest[2:]] if not rest[1].startswith("-")
                        else rest[1:])]
    return ([] if log_level is None else ["--log-level", log_level]) + rest, log_level


def main(argv: list[str] | None = None) -> int:
    from pdserve.services.common.env_check import check_environment

    bad_env = check_environment(os.environ, build_parser)
    if bad_env is not None:  # one line, before a parser reads the value as a default
        print(f"error: {bad_env}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, log_level = normalize_argv(sys.argv[1:] if argv is None else list(argv))
    ns = parser.parse_args(args)
    if log_level is not None:  # a subcommand's own --log-level default must not win
        ns.log_level = log_level
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(ns.func(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
