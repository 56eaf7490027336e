"""The `pdserve` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def _pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", "--log-level", "WARNING", *args,
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
