"""pdserve as a drop-in for vLLM's OpenAI server (issue 14), against ONE real `pdserve up`
(Redis, prefill, decode, gateway as processes) started with an API key, a custom chat
template, one CORS origin, `--metrics-compat vllm` and the static core split:

- the `openai` client: models.retrieve (404 for another name), logit_bias forcing and
  banning a token, an image content part refused with a clear 400;
- the custom chat template is what builds the prompt;
- CORS preflights answered without a key (and refused for another origin);
- /metrics open without a key, carrying every engine's families with `instance` and `role`
  labels, and every `vllm:` name vLLM's example Grafana dashboard queries;
- a second `pdserve up` on the machine does not take the first one's pinned cores;
- last (it ends the stack): SIGTERM while a 3,000-token stream runs, with a 2 s grace: the
  client gets an error event (type server_shutdown) and [DONE], every process exits 0, no
  traceback anywhere in the output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.services.launcher.test_up import _free_port, _health_ok

STARTUP_TIMEOUT = 400.0
API_KEY = "sk-compat-test"
MODEL = "SmolLM2-135M-Instruct"
ORIGIN = "https://ui.example"
# A template unlike SmolLM2's own (ChatML): role names in double angle brackets.
TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>> {% endif %}")
DASHBOARD_NAMES = (
    # every metric name examples/observability/prometheus_grafana/grafana.json queries
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None,
                       reason="redis-server is not installed (apt-get install redis-server)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


@dataclass
class Stack:
    proc: subprocess.Popen
    url: str
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self, key: str = API_KEY):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, timeout=300,
                             max_retries=0)


def _wait(predicate, stack: Stack, what: str, timeout: float = STARTUP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert stack.proc.poll() is None, f"pdserve up exited early:\n{stack.text()[-6000:]}"
        assert time.monotonic() < deadline, f"{what} timed out:\n{stack.text()[-6000:]}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("compat")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    port = _free_port()
    log = tmp / "up.log"
    # --shutdown-timeout 7: the gateway and the engines get 7 - 5 = 2 s of grace.
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--log-level", "INFO",
           "--port", str(port), "--api-key", API_KEY, "--chat-template", str(template),
           "--allowed-origins", json.dumps([ORIGIN]), "--metrics-compat", "vllm",
           "--no-cpu-share", "--kv-cache-memory", "256MiB", "--max-model-len", "4096",
           "--max-num-seqs", "8", "--shutdown-timeout", "7",
           "--startup-timeout", str(STARTUP_TIMEOUT)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    s = Stack(proc, f"http://127.0.0.1:{port}", log)
    try:
        _wait(lambda: _health_ok(s.url + "/health"), s, "gateway /health")
        _wait(lambda: "Stop with Ctrl-C." in s.text(), s, "ready banner")
        yield s
    finally:
        if proc.poll() is None:
            proc.kill()  # its children die with it (PR_SET_PDEATHSIG)
            proc.wait()


def test_models_retrieve_version_ping_docs(stack):
    import openai

    client = stack.client()
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "pdserve")
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert "no-such-model" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        stack.client("wrong").models.retrieve(MODEL)
    # vLLM's plain routes need no key
    version = httpx.get(stack.url + "/version").json()["version"]
    assert re.fullmatch(r"\d+(\.\d+)*.*", version), version
    assert httpx.get(stack.url + "/ping").status_code == 200
    assert httpx.post(stack.url + "/ping").status_code == 200
    docs = httpx.get(stack.url + "/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text and "/openapi.json" in docs.text
    assert "/v1/models/{model}" in httpx.get(stack.url + "/openapi.json").json()["paths"]


def _completion(client, **kwargs):
    return client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=4, temperature=0, logprobs=0, **kwargs)


def test_logit_bias_forces_and_bans_a_token(stack):
    client = stack.client()
    tokens = httpx.post(stack.url + "/tokenize", json={"prompt": " banana"},
                        headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"]
    banana = tokens[-1]
    forced = _completion(client, logit_bias={str(banana): 100})
    assert forced.choices[0].logprobs.tokens == ["Ġbanana"] * 4 or \
        forced.choices[0].text == " banana" * 4, forced
    baseline = _completion(client)
    first = baseline.choices[0].logprobs.tokens[0]
    first_id = httpx.post(stack.url + "/tokenize", json={"prompt": baseline.choices[0].text},
                          headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"][0]
    banned = _completion(client, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first, (baseline, banned)
    # as OpenAI: a key that is no token id is a 400 naming logit_bias
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _completion(client, logit_bias={"not-a-token": 5})
    assert e.value.body["param"] == "logit_bias"


def test_the_custom_chat_template_builds_the_prompt(stack):
    messages = [{"role": "user", "content": "Hi there"}]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    ids = httpx.post(stack.url + "/tokenize", json={"messages": messages},
                     headers=auth).json()["tokens"]
    text = httpx.post(stack.url + "/detokenize", json={"tokens": ids}, headers=auth).json()
    assert text["prompt"] == "<<user>> Hi there\n<<assistant>> "
    assert "<|im_start|>" not in text["prompt"]  # the model's own template is not used
    resp = stack.client().chat.completions.create(model=MODEL, messages=messages,
                                                  max_tokens=2, temperature=0)
    assert resp.usage.prompt_tokens == len(ids)


def test_an_image_part_is_a_clear_400(stack):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        stack.client().chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "https://x.example/cat.png"}}]}])
    assert "image input is not supported by this model" in e.value.body["message"]


def test_cors_preflight_needs_no_key(stack):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    for headers in (preflight, {**preflight, "Authorization": f"Bearer {API_KEY}"}):
        r = httpx.options(stack.url + "/v1/chat/completions", headers=headers)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
    other = httpx.options(stack.url + "/v1/chat/completions",
                          headers={**preflight, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # the request itself still needs the key; its answer carries the CORS header either way
    r = httpx.get(stack.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(stack.url + "/v1/models",
                  headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def _metrics(stack) -> str:
    r = httpx.get(stack.url + "/metrics")  # no key: open, as vLLM's
    assert r.status_code == 200
    return r.text


def test_metrics_federate_the_engines_and_carry_vllm_names(stack):
    # one streamed chat, so every request-level histogram (ITL included) has samples
    stream = stack.client().chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Count to five."}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def federated() -> bool:
        text = _metrics(stack)
        return all(re.search(r'pdserve_num_requests_running\{[^}]*instance="[^"]+"'
                             rf'[^}}]*role="{role}"', text) for role in ("prefill", "decode"))
    _wait(federated, stack, "engine families in the gateway's /metrics", timeout=30)
    text = _metrics(stack)
    for family in ("pdserve_kv_cache_usage_perc", "pdserve_prefix_cache_queries_total",
                   "pdserve_kv_blocks", "pdserve_gateway_requests_total"):
        assert re.search(rf"^{family}\{{", text, re.M), family
    for role in ("prefill", "decode"):
        assert re.search(rf'pdserve_kv_blocks\{{[^}}]*role="{role}"[^}}]*state="free"', text)
    missing = [n for n in DASHBOARD_NAMES
               if not re.search(rf'^{re.escape(n)}\{{[^}}]*model_name="{MODEL}"', text, re.M)]
    assert not missing, missing


def test_a_second_up_keeps_off_the_first_ones_pinned_cores(stack, tmp_path):
    """The first stack runs --no-cpu-share (prefill and decode pinned to their cores). A
    second `pdserve up` either picks cores nobody pinned (and says which) or, when there are
    none left, refuses with one line, before it starts anything."""
    from pdserve.services.launcher.cores import format_cores, pinned_engines

    first = {c for e in pinned_engines(exclude=(os.getpid(),)) for c in e.cores}
    assert first, "the first stack's engines are not pinned"
    log = tmp_path / "second.log"
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--port", str(_free_port()),
           "--no-cpu-share", "--kv-cache-memory", "128MiB", "--max-model-len", "512"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and "using cores" not in log.read_text() \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        if "using cores" in text:  # a machine with cores to spare
            used = re.search(r"using cores ([\d,-]+)", text).group(1)
            from pdserve.shared.engine_args import parse_cores

            assert not set(parse_cores(used)) & first, text
        else:
            assert proc.returncode == 1, text
            lines = [ln for ln in text.splitlines() if "error:" in ln]
            assert len(lines) == 1, text
            assert f"cores {format_cores(sorted(first))} are pinned by another pdserve" \
                in lines[0], text
            assert "starting" not in text, text  # refused before anything started
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def test_sigterm_during_a_long_stream_ends_it_with_an_error_event(stack):
    """Runs last: it stops the module's stack."""
    body = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": "Tell a long story."}]}
    events: list[str] = []
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:  # a few tokens first: the stream is running
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) >= 3:
                break
        signalled = time.monotonic()
        stack.proc.send_signal(signal.SIGTERM)
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
    took = time.monotonic() - signalled
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_shutdown" and error["code"] == 503, error
    tokens = [json.loads(e) for e in events[:-2]]
    assert all(t["choices"][0]["finish_reason"] is None for t in tokens if t["choices"])
    assert 1.5 < took < 6, took  # the 2 s grace, not the 3,000 tokens
    assert stack.proc.wait(timeout=60) == 0, stack.text()[-6000:]
    text = stack.text()
    stopped = text[text.rindex("stopped: "):].splitlines()[0]
    assert re.fullmatch(r".*stopped: (\S+ exit 0(, )?)+", stopped), stopped
    assert stopped.count("exit 0") == 4, stopped  # gateway, prefill-0, decode-0, redis
    assert "Traceback" not in text and "CancelledError" not in text, text[-6000:]
    assert re.search(r"POST /v1/chat/completions 200 [\d.]+s cut \(server_shutdown\)", text)
    # a normal start and an orderly stop warn about nothing of theirs
    assert not re.search(r"GetState .* failed: UNAVAILABLE", text)
    assert not re.search(r"\[(gateway|prefill-0|decode-0)\] .* (WARNING|ERROR) ", text), text
