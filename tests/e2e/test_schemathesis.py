"""Issue 13 item 6: schemathesis against the gateway's own /openapi.json, over REAL engines.

The gateway (uvicorn, its own thread and event loop, as test_fuzz.py runs it) fronts a real
prefill and a real decode service. Every operation of the document is fuzzed with
schemathesis's positive (schema-valid) and negative (schema-breaking) cases, on top of the
hand-written hypothesis bodies of tests/services/gateway/test_fuzz.py. Generated
`max_tokens` / `n` are capped (CAPS) so the CPU engines answer in well under a second.

Per request: no 5xx, no dropped connection (requests raises), every error is an OpenAI error
object. Afterwards: at least MIN_REQUESTS sent, a normal chat still answers, and neither pool
has a block in use or pinned (GetState with check_invariants).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.e2e.conftest import E2E_ENGINE, Urls
from tests.services.gateway.conftest import SERVED_MODEL, running_gateway
from tests.services.helpers import start_cluster, wait_leak_free

MIN_REQUESTS = 500
EXAMPLES = {  # (path, method) -> generated cases (positive and negative mixed)
    ("/v1/completions", "POST"): 190,
    ("/v1/chat/completions", "POST"): 190,
    ("/tokenize", "POST"): 60,
    ("/detokenize", "POST"): 60,
    ("/v1/models/{model}", "GET"): 15,
}
"""The other operations (no body, no parameter) are each called a few times."""
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "best_of": 2, "min_tokens": 4}
"""Generated integers above these are lowered to them (CPU engines, one test budget)."""
GENERATION = ("/v1/completions", "/v1/chat/completions")
TALLY: Counter = Counter()
"""(path, status) -> responses; "sent" -> requests."""


@pytest.fixture(scope="module")
def stack(model_path):
    """(gateway url, cluster) in a thread of their own: the test calls are blocking."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    async def serve() -> None:
        box["stop"] = asyncio.Event()
        cluster = await start_cluster(model_path, None, **E2E_ENGINE)
        try:
            urls = Urls((cluster.prefill.identity.address,), (cluster.decode.identity.address,))
            async with running_gateway(model_path, urls, rpc_timeout=10.0) as gw:  # type: ignore[arg-type]
                box.update(url=gw.url, cluster=cluster, loop=loop)
                started.set()
                await box["stop"].wait()
        finally:
            await cluster.close()

    def run() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as e:  # shown below
            box["error"] = e
        finally:
            started.set()

    thread = threading.Thread(target=run, name="schemathesis-stack", daemon=True)
    thread.start()
    assert started.wait(600) and "url" in box, box.get("error")
    yield box
    loop.call_soon_threadsafe(box["stop"].set)
    thread.join(120)
    assert not thread.is_alive()
    loop.close()
    assert "error" not in box, box.get("error")


@pytest.fixture(scope="module")
def schema(stack):
    return schemathesis.openapi.from_url(f"{stack['url']}/openapi.json")


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        yield s


def _capped(path: str, body: dict) -> dict:
    """The generated body with CAPS applied (other values untouched, junk stays junk); a
    generation request without a length limit gets max_tokens 4 (else: the whole context)."""
    for key, cap in CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if path in GENERATION and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = CAPS["max_tokens"]
    return body


def _send(stack, session, case) -> None:
    if isinstance(case.body, dict):
        case.body = _capped(case.operation.path, case.body)
    # requests raises on a dropped connection (and a reply over 60 s fails too)
    response = case.call(base_url=stack["url"], session=session, timeout=60)
    TALLY["sent"] += 1
    TALLY[(case.operation.path, response.status_code)] += 1
    assert response.status_code < 500, (case.as_curl_command(), response.status_code,
                                        response.text)
    ctype = ",".join(response.headers.get("content-type", []))  # schemathesis: lists
    if response.status_code >= 400 and ctype.startswith("application/json"):
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], response.text
        assert error["code"] == response.status_code, response.text


SETTINGS = dict(deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("operation", list(EXAMPLES), ids=lambda o: f"{o[1]} {o[0]}")
def test_schemathesis_operation(stack, schema, session, operation):
    path, method = operation
    op = schema[path][method]
    strategies = st.one_of(op.as_strategy(GenerationMode.POSITIVE),
                           op.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=EXAMPLES[operation], **SETTINGS)
    @given(case=strategies)
    def run(case):
        _send(stack, session, case)

    run()


def test_schemathesis_other_operations(stack, schema, session):
    """Every operation of the document not fuzzed above (GETs without parameters)."""
    fuzzed = {path for path, _ in EXAMPLES}
    others = [op for op in schema.get_all_operations()]
    called = 0
    for result in others:
        op = result.ok()
        if op.path in fuzzed:
            continue

        @settings(max_examples=3, **SETTINGS)
        @given(case=op.as_strategy(GenerationMode.POSITIVE))
        def run(case):
            _send(stack, session, case)

        run()
        called += 1
    assert called >= 5  # /v1/models, /health, /version, /metrics, /openapi.json, ...


def test_schemathesis_left_the_stack_serving_and_empty(stack, session):
    print(f"\nschemathesis tally: {TALLY['sent']} requests; "
          f"{sorted((k, v) for k, v in TALLY.items() if k != 'sent')}")
    assert TALLY["sent"] >= MIN_REQUESTS
    statuses = [k[1] for k in TALLY if k != "sent"]
    assert 200 in statuses and 400 in statuses  # both accepted and refused bodies were sent
    r = session.post(f"{stack['url']}/v1/chat/completions", timeout=120, json={
        "model": SERVED_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    states = asyncio.run_coroutine_threadsafe(
        wait_leak_free(stack["cluster"], timeout=30.0), stack["loop"]).result(60)
    for s in states:
        assert s.invariants_ok, s.invariants_error
        assert (s.num_used_blocks, s.num_pinned_blocks, s.num_running, s.num_waiting) == \
            (0, 0, 0, 0), s
