"""Overload end to end (issue 6): the gateway PROCESS (`python -m services.gateway
--max-num-queued-requests 8`, uvloop, as deployed) in front of fake prefill/decode engines on
real gRPC (this process) whose prefill is held by a gate and whose decode has a slow cadence.

The acceptance is about the gateway's own queue, so the engines are fakes: they make the
numbers exact (the gate holds the first 8 admitted requests waiting until every first attempt
has its answer) and cost no CPU. 4 x 8 = 32 clients stream at once:

1. first attempts: exactly 8 admitted, 24 refused with 429 + Retry-After (OpenAI error object);
2. the refused clients retry after Retry-After (bounded) until all 32 are accepted; running
   streams are not bounded by the queue, so more than 8 are in flight at once;
3. every accepted stream completes with the undisturbed greedy answer;
4. /health and /metrics, polled every 100 ms throughout, always answer within 1 s;
5. afterwards the gateway's queue gauges read 0 and the engines hold nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.services.gateway.tokenization import load_tokenizer
from pdserve.services.proto import engine_pb2_grpc
from tests.services.gateway.conftest import SERVED_MODEL
from tests.services.gateway.fake_engine import (
    SCRIPT_TEXT,
    FakeCluster,
    FakeDecode,
    FakeModel,
    FakePrefill,
)
from tests.services.gateway.helpers import CHAT, parse_sse

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

QUEUE = 8
CLIENTS = 4 * QUEUE
MAX_TOKENS = 20
TOKEN_DELAY = 0.1  # s per decode token: a stream runs ~2 s, longer than a retry wave
MAX_ATTEMPTS = 15
HEALTH_BOUND = 1.0  # s: the acceptance bound on /health and /metrics
NUMBERS: dict[str, object] = {}
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatedPrefill(FakePrefill):
    """A fake prefill that answers only once `gate` is open."""

    gate: asyncio.Event
    arrived = 0

    async def Prefill(self, request, context):
        self.arrived += 1
        await self.gate.wait()
        return await super().Prefill(request, context)


async def _serve(servicer, add) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server()
    add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    servicer.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(model_path) -> AsyncIterator[FakeCluster]:
    tok = load_tokenizer(model_path)
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)
    model = FakeModel(script + [tok.eos_token_id], tok.eos_token_id, len(tok))
    prefill, decode = GatedPrefill(model, "prefill-0"), FakeDecode(model, "decode-0")
    prefill.gate = asyncio.Event()
    prefill.gate.set()
    decode.rec.delay = TOKEN_DELAY
    p_server, p_health = await _serve(prefill, engine_pb2_grpc.add_PrefillServiceServicer_to_server)
    d_server, d_health = await _serve(decode, engine_pb2_grpc.add_DecodeServiceServicer_to_server)
    cluster = FakeCluster([prefill], [decode], {prefill.address: p_health,
                                                decode.address: d_health}, [p_server, d_server])
    yield cluster
    await cluster.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway_url(model_path, engines, tmp_path_factory) -> AsyncIterator[str]:
    """`python -m services.gateway` on a free port; killed at the end (also on failure)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("overload") / "gateway.log"
    cmd = [sys.executable, "-m", "pdserve.services.gateway", "--host", "127.0.0.1",
           "--port", str(port),
           "--model", model_path, "--served-model-name", SERVED_MODEL,
           "--prefill-url", engines.prefills[0].address,
           "--decode-url", engines.decodes[0].address,
           "--max-num-queued-requests", str(QUEUE), "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=2) as http:
            for _ in range(600):  # <= 60 s to import, load the tokenizer and see the engines
                assert proc.poll() is None, log_path.read_text()[-3000:]
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("gateway not healthy: " + log_path.read_text()[-3000:])
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _chat_body() -> dict:
    return {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Count, please."}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def _stream_once(http: httpx.AsyncClient, state: dict) -> tuple[int, str | dict]:
    """(200, streamed text + usage) or (status, error object + retry_after)."""
    async with http.stream("POST", CHAT, json=_chat_body()) as r:
        if r.status_code != 200:
            await r.aread()
            err = r.json()["error"]
            return r.status_code, {**err, "retry_after": r.headers.get("retry-after")}
        state["open"] += 1
        state["peak_open"] = max(state["peak_open"], state["open"])
        try:
            events = parse_sse((await r.aread()).decode())
        finally:
            state["open"] -= 1
    assert events[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in events[:-1] if c["choices"])
    usage = [c["usage"] for c in events[:-1] if c.get("usage")]
    finish = [c["choices"][0]["finish_reason"] for c in events[:-1]
              if c["choices"] and c["choices"][0]["finish_reason"]]
    assert not any("error" in c for c in events[:-1])
    return 200, {"text": text, "usage": usage[-1], "finish": finish}


async def _client(http: httpx.AsyncClient, state: dict) -> dict:
    attempts, refusals = 0, []
    while attempts < MAX_ATTEMPTS:
        attempts += 1
        task = asyncio.ensure_future(_stream_once(http, state))
        if attempts == 1:
            state["first_pending"].append(task)
        status, result = await task
        if status == 200:
            return {"attempts": attempts, "refusals": refusals, **result}
        assert status == 429, (status, result)
        refusals.append(result)
        await asyncio.sleep(int(result["retry_after"]))
    raise AssertionError(f"not admitted in {MAX_ATTEMPTS} attempts")


def _poll_health(url: str, stop: threading.Event, latencies: dict) -> None:
    """GET /health and /metrics every ~100 ms until `stop`, from a thread of its own (so the
    latencies are the gateway's, not this test's busy event loop's)."""
    with httpx.Client(base_url=url, timeout=10) as http:
        while not stop.is_set():
            for path in ("/health", "/metrics"):
                t0 = time.perf_counter()
                r = http.get(path)
                latencies[path].append(time.perf_counter() - t0)
                assert r.status_code == 200, (path, r.status_code)
                if path == "/metrics":
                    latencies["peak_waiting"] = max(latencies["peak_waiting"],
                                                    _gauge(r.text, "waiting"))
                    latencies["peak_running"] = max(latencies["peak_running"],
                                                    _gauge(r.text, "running"))
            stop.wait(0.1)


def _gauge(metrics: str, name: str) -> float:
    m = re.search(rf"^pdserve_gateway_num_engine_requests_{name} (\S+)$", metrics, re.M)
    assert m, metrics
    return float(m.group(1))


async def test_overload_429_with_retry_after_and_responsive_health(gateway_url, engines):
    limits = httpx.Limits(max_connections=CLIENTS + 4)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60, limits=limits) as http:
        status, reference = await _stream_once(http, {"open": 0, "peak_open": 0})
        assert status == 200 and reference["usage"]["completion_tokens"] == MAX_TOKENS
        latencies: dict = {"/health": [], "/metrics": [], "peak_waiting": 0.0,
                           "peak_running": 0.0}
        stop = threading.Event()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="health-poll")
        poller = pool.submit(_poll_health, gateway_url, stop, latencies)
        engines.prefills[0].gate.clear()  # the admitted first attempts wait at the prefill
        state = {"open": 0, "peak_open": 0, "first_pending": []}
        t0 = time.monotonic()
        clients = [asyncio.ensure_future(_client(http, state)) for _ in range(CLIENTS)]
        try:
            for _ in range(300):  # <= 30 s: every refused first attempt has its answer
                done = [t for t in state["first_pending"] if t.done()]
                if len(state["first_pending"]) == CLIENTS and len(done) == CLIENTS - QUEUE:
                    break
                await asyncio.sleep(0.1)
            first_refused = [t.result() for t in state["first_pending"] if t.done()]
            assert len(first_refused) == CLIENTS - QUEUE
            # The admitted attempts reach the gated prefill a moment after the refusals are
            # answered (under load, after them): wait, bounded, for them to arrive.
            for _ in range(100):
                if engines.prefills[0].arrived >= 1 + QUEUE:
                    break
                await asyncio.sleep(0.05)
            assert engines.prefills[0].arrived == 1 + QUEUE  # + the reference request
            assert _gauge((await http.get("/metrics")).text, "waiting") == QUEUE
            engines.prefills[0].gate.set()
            results = await asyncio.wait_for(asyncio.gather(*clients), timeout=120)
        finally:
            engines.prefills[0].gate.set()
            stop.set()
            for c in clients:
                c.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            poller_error = poller.exception(30)  # waits for the thread to stop
            pool.shutdown()
        elapsed = time.monotonic() - t0
        assert poller_error is None, poller_error

        # 1. the excess of the burst got 429 + Retry-After, as OpenAI error objects
        for status, err in first_refused:
            assert status == 429 and err["code"] == 429 and err["type"] and err["message"]
            assert int(err["retry_after"]) >= 1
        refusals = [r for res in results for r in res["refusals"]]
        assert sum(1 for res in results if res["attempts"] == 1) == QUEUE
        # 3. every accepted stream completed with the undisturbed answer
        for res in results:
            assert res["text"] == reference["text"] and res["finish"] == ["length"]
            assert res["usage"]["completion_tokens"] == MAX_TOKENS
        # 2. waiting stayed bounded while more streams than the queue ran
        assert latencies["peak_waiting"] <= QUEUE
        assert state["peak_open"] > QUEUE
        # 4. health and metrics answered within the bound throughout
        worst = {p: max(latencies[p]) for p in ("/health", "/metrics")}
        assert len(latencies["/health"]) >= 10
        assert worst["/health"] < HEALTH_BOUND and worst["/metrics"] < HEALTH_BOUND, worst
        # 5. nothing left behind
        metrics = (await http.get("/metrics")).text
        assert _gauge(metrics, "waiting") == 0 and _gauge(metrics, "running") == 0
        assert re.search(r"^pdserve_gateway_queued_tokens 0\.0$", metrics, re.M)
        rejected = re.search(r'^pdserve_gateway_requests_rejected_total\{reason="requests"\} '
                             r"(\S+)$", metrics, re.M)
        assert rejected and float(rejected.group(1)) == len(refusals)
        assert not engines.decodes[0].rec.active and not engines.prefills[0].rec.active
    NUMBERS.update(
        clients=CLIENTS, queue=QUEUE, attempts=sum(r["attempts"] for r in results),
        first_attempt_429=len(first_refused), total_429=len(refusals), completed=len(results),
        peak_streams_open=state["peak_open"], peak_waiting=latencies["peak_waiting"],
        peak_running=latencies["peak_running"], health_polls=len(latencies["/health"]),
        worst_health_s=round(worst["/health"], 3), worst_metrics_s=round(worst["/metrics"], 3),
        seconds=round(elapsed, 1))
    print(f"overload numbers: {NUMBERS}")
