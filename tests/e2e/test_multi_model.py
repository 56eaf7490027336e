"""Two models behind one `pdserve up` (issue 31): the default SmolLM2 and a tiny random Llama
under its own name, each with its own prefill and decode replica. Through the `openai`
client each answers under its own name with its own greedy tokens (equal to transformers
fp32 offline), every request lands on its own model's engines (their metrics, labelled
model_name, scraped directly and through the gateway's /metrics), /v1/models lists both,
an unknown model is vLLM's 404."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.services.launcher.test_up import _free_port, _health_ok, _wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None,
                       reason="redis-server is not installed (apt-get install redis-server)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

SMOL = "SmolLM2-135M-Instruct"
TINY = "tiny-llama"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8


def _offline_greedy(model, prompt_ids: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS,
                             do_sample=False, min_new_tokens=MAX_TOKENS)
    return out[0, len(prompt_ids):].tolist()


def _engine_metrics(banner: str) -> dict[str, list[str]]:
    """model name -> the /metrics text of each of its engines (URLs from the banner)."""
    out: dict[str, list[str]] = {}
    for line in banner.splitlines():
        m = re.search(r"metrics (http://\S+/metrics).*model (\S+)", line)
        if m and " grpc " in line:
            with urllib.request.urlopen(m.group(1), timeout=10) as resp:
                out.setdefault(m.group(2), []).append(resp.read().decode())
    return out


def _sum(text: str, metric: str) -> tuple[float, set[str]]:
    """The sum of a metric's samples and the model_name labels they carry."""
    total, models = 0.0, set()
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            models.add(re.search(r'model_name="([^"]*)"', line).group(1))
            total += float(line.rsplit(" ", 1)[1])
    return total, models


def test_two_models_behind_one_pdserve_up(model_path, tmp_path):
    import openai
    import torch
    import transformers

    from tests.shared.models.test_architectures import build_checkpoint

    tiny_dir = tmp_path / TINY
    tiny_hf = build_checkpoint(tiny_dir, "LlamaConfig", tie_word_embeddings=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    smol_hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32).eval()
    expected = {SMOL: [_offline_greedy(smol_hf, ids) for ids in prompt_ids],
                TINY: [_offline_greedy(tiny_hf, ids) for ids in prompt_ids]}
    del smol_hf, tiny_hf
    assert expected[SMOL] != expected[TINY]

    port = _free_port()
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--port", str(port),
           "--model", model_path, "--served-model-name", SMOL, "--model", str(tiny_dir),
           "--kv-cache-memory", "128MiB", "--max-model-len", "512", "--max-num-seqs", "4",
           "--dtype", "float32", "--shutdown-timeout", "30", "--startup-timeout", "400"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(lambda: _health_ok(url + "/health"), proc, log, "gateway /health")
        _wait_for(lambda: "Stop with Ctrl-C." in log.read_text(), proc, log, "ready banner")
        text = log.read_text()
        banner = text[text.index("pdserve is ready"):]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=300,
                               max_retries=0)

        assert {m.id for m in client.models.list().data} == {SMOL, TINY}
        assert client.models.retrieve(TINY).root == str(tiny_dir)
        for name in (SMOL, TINY):
            for ids, want in zip(prompt_ids, expected[name], strict=True):
                resp = client.completions.create(
                    model=name, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
                assert resp.model == name
                got = [int(t.removeprefix("token_id:")) for t in resp.choices[0].logprobs.tokens]
                assert got == want, (name, PROMPTS[prompt_ids.index(ids)])
        chat = client.chat.completions.create(
            model=TINY, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "Hi"}])
        assert chat.model == TINY and chat.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        assert e.value.body["message"] == "The model `no-such-model` does not exist."

        # each request on its own model's engines: 2 completions on SmolLM2's decode,
        # 2 completions + 1 chat on the tiny model's
        engines = _engine_metrics(banner)
        assert sorted(engines) == [SMOL, TINY] and all(len(v) == 2 for v in engines.values())
        for name, want in ((SMOL, 2), (TINY, 3)):
            finished = [_sum(t, "pdserve_request_success_total") for t in engines[name]]
            assert sum(n for n, _ in finished) == want, (name, finished)
            assert set().union(*(labels for _, labels in finished)) == {name}
        # the gateway's /metrics: both models' engines, and its own families per model
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            federated = resp.read().decode()
        for name, want in ((SMOL, 2), (TINY, 3)):
            rows = [line for line in federated.splitlines()
                    if f'model_name="{name}"' in line]
            assert sum(float(r.rsplit(" ", 1)[1]) for r in rows
                       if r.startswith("pdserve_gateway_request_success_total{")) == want
            assert sum(float(r.rsplit(" ", 1)[1]) for r in rows if r.startswith(
                "pdserve_request_success_total{") and 'role="decode"' in r) == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

