"""The `pdserve` command: convert, generate, serve {prefill,decode,gateway}, up, healthcheck.

As `vllm serve MODEL`: `pdserve serve MODEL [flags]` (a model, not a role, after `serve`)
runs the whole stack, i.e. `pdserve up --model MODEL [flags]`. Global flags (`--log-level`)
work before or after the subcommand.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _cmd_convert(ns: argparse.Namespace) -> int:
    from shared.models.convert import resolve_model_path

    print(resolve_model_path(ns.model))
    return 0


def _cmd_generate(ns: argparse.Namespace) -> int:
    from shared.engine_args import EngineArgs
    from shared.llm import LLM
    from shared.sampling_params import SamplingParams

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
    from shared.engine_args import EngineArgs

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
    """The services' subcommands (serve, healthcheck); they import their modules lazily."""
    from services.commands import add_service_commands

    add_service_commands(sub)


def _add_up_command(sub) -> None:
    """`pdserve up`: the local launcher (services/launcher/)."""
    from services.launcher.cli import add_up_command

    add_up_command(sub)


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
    import os

    from services.common.env_check import check_environment

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
