"""The `pdserve` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.services.cli", "--log-level", "WARNING",
                           *args,
                           "--kv-cache-memory", "64MiB", "--max-model-len", "256"],
                          capture_output=True, text=True, timeout=300)


def test_generate_json_is_greedy_and_exact(model_path):
    p = _pdserve("generate", "--prompt", "The capital of France is", "--max-tokens", "5",
                 "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
    assert out["text"].strip().startswith("Paris")


def test_generate_chat_from_messages_json(model_path):
    msgs = json.dumps([{"role": "user", "content": "Say hi."}])
    p = _pdserve("generate", "--messages-json", msgs, "--max-tokens", "40", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["finish_reason"] == "stop" and out["token_ids"][-1] == 2
    assert out["prompt_token_ids"][:3] == [1, 9690, 198]  # <|im_start|>system\n


def test_generate_bad_input_exits_2_with_the_field_named(model_path):
    p = _pdserve("generate", "--prompt", "hi", "--max-tokens", "0")
    assert p.returncode == 2 and "max_tokens" in p.stderr


def test_vllm_style_command_lines_parse():
    """`pdserve serve MODEL` is `pdserve up --model MODEL` (as `vllm serve MODEL`); global
    flags work after the subcommand too; the gateway's compat flags reach `up`."""
    from pdserve.services.cli import build_parser, normalize_argv
    from pdserve.services.launcher.config import config_from_args

    parser = build_parser()
    args, level = normalize_argv(["serve", "/models/x", "--port", "9000", "--log-level",
                                  "DEBUG", "--seed", "7", "--chat-template", "t.jinja",
                                  "--allowed-origins", '["https://a.example"]',
                                  "--metrics-compat", "vllm"])
    ns = parser.parse_args(args)
    assert (ns.command, ns.model, ns.port, ns.log_level, level) == \
        ("up", "/models/x", 9000, "DEBUG", "DEBUG")
    config = config_from_args(ns)
    assert config.engine_args.seed == 7 and config.log_level == "DEBUG"
    flags = config.gateway_flags
    assert flags[flags.index("--chat-template") + 1] == "t.jinja"
    assert flags[flags.index("--allowed-origins") + 1] == '["https://a.example"]'
    assert flags[flags.index("--metrics-compat") + 1] == "vllm"
    for argv in (["up", "--log-level", "DEBUG"], ["--log-level", "DEBUG", "up"],
                 ["up", "--log-level=DEBUG"]):
        args, _ = normalize_argv(argv)
        assert parser.parse_args(args).log_level == "DEBUG"
    args, _ = normalize_argv(["serve", "gateway", "--port", "1"])
    assert parser.parse_args(args).serve_role == "gateway"


def test_a_vllm_serve_command_line_runs_here(model_path, monkeypatch):
    """The flags a `vllm serve` command line commonly carries parse; --dtype's vLLM values
    resolve (auto: bfloat16 on a CPU with AVX512-BF16, else float32; bfloat16 refused
    without it); parallel sizes other than 1 are refused by name; the
    engines get the flags back from `pdserve up` unchanged."""
    from pdserve.services.cli import build_parser, normalize_argv
    from pdserve.services.launcher.config import config_from_args
    from pdserve.services.launcher.plan import engine_flags
    from pdserve.shared.engine_args import EngineArgs

    parser = build_parser()
    args, _ = normalize_argv(["serve", model_path, "--dtype", "auto", "-tp", "1",
                              "--gpu-memory-utilization", "0.9", "--trust-remote-code",
                              "--enforce-eager", "--disable-log-requests"])
    config = config_from_args(parser.parse_args(args))
    engine = config.engine_args
    assert (engine.dtype, engine.tensor_parallel_size, engine.gpu_memory_utilization,
            engine.trust_remote_code, engine.enforce_eager) == ("auto", 1, 0.9, True, True)
    from pdserve.kernels import cpu_features  # auto: bf16 where the CPU has it, as vLLM's

    has_bf16 = cpu_features.has_bf16_instructions()
    assert engine.create_engine_configs()[0].dtype == ("bfloat16" if has_bf16 else "float32")
    flags = engine_flags(engine)
    assert "--trust-remote-code" in flags and flags[flags.index("--dtype") + 1] == "auto"
    for value, expected in (("float", "float32"), ("half", "float16"),
                            ("bfloat16", "bfloat16")):
        assert EngineArgs(model=model_path, dtype=value).resolve_dtype({}) == expected
    assert EngineArgs(dtype="auto", device="cuda").resolve_dtype(
        {"torch_dtype": "bfloat16"}) == "bfloat16"
    with monkeypatch.context() as m:  # a CPU without AVX512-BF16: auto is fp32, bf16 refused
        m.setattr(cpu_features, "has_bf16_instructions", lambda: False)
        assert EngineArgs(model=model_path, dtype="auto").resolve_dtype({}) == "float32"
        with pytest.raises(ValueError, match="needs AVX512-BF16"):
            EngineArgs(model=model_path, dtype="bfloat16").resolve_dtype({})
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineArgs(model=model_path, tensor_parallel_size=2).create_engine_configs()


def test_seed_reaches_the_sampler(model_path):
    """--seed (vLLM's server seed) seeds the sampler's generator of unseeded requests."""
    from pdserve.services.cli import build_parser
    from pdserve.shared.engine_args import EngineArgs

    ns = build_parser().parse_args(["serve", "decode", "--model", model_path, "--seed", "1234"])
    args = EngineArgs.from_cli_args(ns)
    assert args.seed == 1234 and args.create_engine_configs()[0].seed == 1234
    assert EngineArgs(model=model_path).create_engine_configs()[0].seed is None
