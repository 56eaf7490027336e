"""Gateway flags out of range are refused at start-up: a ValueError naming the flag, which
the CLI turns into a one-line error and exit status 2 (never a busy-spinning health loop)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.services.gateway.__main__ import build_parser, main
from pdserve.services.gateway.config import GatewayConfig, config_from_cli_args

REPO = Path(__file__).resolve().parents[3]
BAD_FLAGS = [
    ("--health-check-interval", "0"),
    ("--health-check-interval", "-1"),
    ("--health-check-interval", "nan"),
    ("--rpc-timeout", "0"),
    ("--request-timeout", "-5"),
    ("--max-request-retries", "-1"),
    ("--max-num-queued-requests", "-1"),
    ("--max-queued-tokens", "-1"),
    ("--max-logprobs", "-1"),
    ("--max-stop-strings", "-1"),
    ("--max-stop-string-length", "-1"),
    ("--max-body-size", "0"),
    ("--block-size", "0"),
    ("--max-model-len", "-4"),
    ("--local-prefill-threshold", "-1"),
    ("--grace-period", "-1"),
    ("--port", "70000"),
]


def _config(model_path: str, *flags: str) -> GatewayConfig:
    return config_from_cli_args(build_parser().parse_args(["--model", model_path, *flags]))


@pytest.mark.parametrize("flag,value", BAD_FLAGS)
def test_out_of_range_flag_is_a_value_error_naming_it(model_path, flag, value):
    with pytest.raises(ValueError, match=f"^{flag} must be"):
        _config(model_path, flag, value)


def test_max_n_must_be_at_least_one(model_path):
    with pytest.raises(ValueError, match="^--max-n must be > 0, got 0$"):
        GatewayConfig(model_path=model_path, max_n=0)


def test_zero_where_it_means_no_limit_and_defaults_are_accepted(model_path):
    config = _config(model_path, "--max-num-queued-requests", "0", "--max-queued-tokens", "0",
                     "--max-request-retries", "0", "--max-logprobs", "0",
                     "--health-check-interval", "0.05")
    assert (config.max_num_queued_requests, config.max_queued_tokens,
            config.max_request_retries, config.max_logprobs) == (0, 0, 0, 0)
    assert config.health_check_interval == 0.05
    assert _config(model_path).health_check_interval == 1.0


def test_cli_prints_one_line_and_exits_2(model_path, capsys):
    assert main(["--model", model_path, "--health-check-interval", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --health-check-interval must be > 0, got 0.0\n"


def test_cli_process_has_no_traceback(model_path):
    """The real entry point, as `python -m services.gateway` runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.services.gateway", "--model", model_path,
         "--max-request-retries", "-3"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --max-request-retries must be >= 0, got -3"]


def test_vllm_compat_flags(model_path, tmp_path):
    """vLLM's spellings: CORS lists as JSON (or comma lists), --chat-template a file or the
    template itself, --tokenizer a directory; a template path that names no file is refused."""
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    c = _config(model_path, "--allowed-origins", '["https://a.example", "https://b.example"]',
                "--allowed-methods", "GET,POST", "--allow-credentials", "--chat-template",
                str(template), "--tokenizer", model_path, "--protect-metrics",
                "--metrics-compat", "vllm")
    assert c.allowed_origins == ("https://a.example", "https://b.example")
    assert (c.allowed_methods, c.allowed_headers) == (("GET", "POST"), ("*",))
    assert c.allow_credentials and c.protect_metrics and c.metrics_compat == "vllm"
    assert c.chat_template == "{{ messages[0]['content'] }}" and c.tokenizer == model_path
    assert _config(model_path, "--chat-template", "{{ 1 }}").chat_template == "{{ 1 }}"
    d = _config(model_path)
    assert (d.allowed_origins, d.chat_template, d.protect_metrics) == (("*",), None, False)
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        _config(model_path, "--chat-template", str(tmp_path / "missing.jinja"))


def test_a_tokenizer_that_is_not_there_names_the_flag(model_path, tmp_path):
    """`--tokenizer HuggingFaceTB/SmolLM2-135M-Instruct` (a hub id, as vLLM users pass) or a
    wrong directory: the one-line error names --tokenizer, not the model."""
    for value in ("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "nope")):
        with pytest.raises(FileNotFoundError, match="^--tokenizer: "):
            _config(model_path, "--tokenizer", value)


def test_secrets_never_reach_the_logged_config(model_path):
    """The gateway logs its config at start (`__main__`): the internal token (which guards
    the engines' gRPC) and the admin keys stay out of it; the API key shows as ***."""
    from pdserve.services.gateway.__main__ import loggable

    config = GatewayConfig(model_path=model_path, internal_token="tok-s3cret",
                           admin_api_key="adm-s3cret", api_key="api-s3cret")
    shown = str(loggable(config))
    assert "s3cret" not in shown, shown
    assert config.internal_token == "tok-s3cret"  # still there, only not shown
