"""Issue 6: the waiting queue (429 + Retry-After, released on every exit path), the input
limits (each a 400 naming its param), prompt sizes bounded before tokenizing (/tokenize and
the sum of a request's prompts), one stop table per request, and /openapi.json. Real gateway,
fake engines."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
import pytest_asyncio

from pdserve.services.gateway import serving
from pdserve.services.gateway.admission import AdmissionQueue
from pdserve.services.gateway.openapi import openapi_path
from tests.services.gateway.conftest import running_gateway
from tests.services.gateway.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error_object,
    chat_body,
    completion_body,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _queue(gw) -> AdmissionQueue:
    return gw.app.state.gateway.completion.admission


async def _wait_for(predicate, timeout=3.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _drained(gw) -> None:
    q = _queue(gw)
    await _wait_for(lambda: (q.num_waiting, q.num_running, q.queued_tokens) == (0, 0, 0))


# ---- the queue in the gateway


async def test_full_queue_answers_429_and_health_stays_up(make_gateway):
    gw = await make_gateway(max_num_queued_requests=2, api_key="k")
    auth = {"Authorization": "Bearer k"}
    gw.prefill.rec.delay = 0.6  # the admitted requests wait for their first token
    body = chat_body(max_tokens=3, temperature=0)
    held = [asyncio.ensure_future(gw.http.post(CHAT, json=body, headers=auth))
            for _ in range(2)]
    await _wait_for(lambda: len(gw.prefill.rec.requests) == 2)
    assert _queue(gw).num_waiting == 2
    r = await gw.http.post(CHAT, json=body, headers=auth)
    err = assert_error_object(r, 429)
    assert int(r.headers["retry-after"]) >= 1 and err["code"] == 429
    r = await gw.http.post(COMPLETIONS, json=completion_body(stream=True), headers=auth)
    assert_error_object(r, 429)  # streamed too: a plain JSON error before any event
    assert (await gw.http.get("/health")).status_code == 200
    metrics = (await gw.http.get("/metrics", headers=auth)).text
    assert "pdserve_gateway_num_engine_requests_waiting 2.0" in metrics
    assert 'pdserve_gateway_requests_rejected_total{reason="requests"} 2.0' in metrics
    for t in held:
        assert (await t).status_code == 200
    await _drained(gw)
    assert (await gw.http.post(CHAT, json=body, headers=auth)).status_code == 200
    metrics = (await gw.http.get("/metrics", headers=auth)).text
    assert "pdserve_gateway_num_engine_requests_waiting 0.0" in metrics


async def test_queued_tokens_bound(make_gateway):
    gw = await make_gateway(max_queued_tokens=300)
    gw.prefill.rec.delay = 0.5
    first = asyncio.ensure_future(gw.http.post(COMPLETIONS, json=completion_body(
        [7] * 50, max_tokens=150)))
    await _wait_for(lambda: gw.prefill.rec.requests)
    assert _queue(gw).queued_tokens == 200
    r = await gw.http.post(COMPLETIONS, json=completion_body([7] * 50, max_tokens=60))
    assert_error_object(r, 429)
    assert r.headers["retry-after"]
    ok = await gw.http.post(COMPLETIONS, json=completion_body([7] * 50, max_tokens=40))
    assert ok.status_code == 200
    assert (await first).status_code == 200
    err = assert_error_object(await gw.http.post(COMPLETIONS, json=completion_body(
        [7] * 50, max_tokens=251)), 400)  # could never fit
    assert err["param"] == "max_tokens"
    await _drained(gw)


async def test_engine_overload_429_has_retry_after(gateway):
    gateway.prefill.rec.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
    r = await gateway.http.post(CHAT, json=chat_body())
    assert_error_object(r, 429)
    assert r.headers["retry-after"] == "1"
    await _drained(gateway)


@pytest.mark.parametrize("exit_path", [
    "finish", "stop_string", "n_streamed", "engine_error", "invalid_at_decode",
    "gone_while_waiting", "gone_mid_stream", "timeout_non_streamed"])
async def test_queue_released_on_every_exit_path(gateway, exit_path):
    gw, http = gateway, gateway.http
    long = dict(max_tokens=1000, ignore_eos=True, temperature=0.8)
    if exit_path == "finish":
        assert (await http.post(CHAT, json=chat_body(max_tokens=5))).status_code == 200
    elif exit_path == "stop_string":
        r = await http.post(COMPLETIONS, json=completion_body(stop=["3"], temperature=0))
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    elif exit_path == "n_streamed":
        r = await http.post(CHAT, json=chat_body(n=3, max_tokens=4, stream=True))
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    elif exit_path == "engine_error":  # no instance left to fail over to
        gw.prefill.rec.fail_with = gw.decode.rec.fail_with = grpc.StatusCode.UNAVAILABLE
        assert_error_object(await http.post(CHAT, json=chat_body(temperature=0)), 503)
    elif exit_path == "invalid_at_decode":
        gw.decode.rec.fail_with = grpc.StatusCode.INVALID_ARGUMENT
        assert_error_object(await http.post(CHAT, json=chat_body(temperature=0)), 400)
    elif exit_path == "gone_while_waiting":
        gw.prefill.rec.delay = 5.0
        with pytest.raises(httpx.ReadTimeout):
            await http.post(CHAT, json=chat_body(stream=True), timeout=0.3)
    elif exit_path == "gone_mid_stream":
        gw.decode.rec.delay = 0.02
        async with http.stream("POST", COMPLETIONS, json=completion_body(
                n=2, stream=True, **long)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break
    else:
        gw.decode.rec.delay = 0.02
        with pytest.raises(httpx.ReadTimeout):
            await http.post(CHAT, json=chat_body(**long), timeout=0.4)
    await _drained(gw)
    await _wait_for(lambda: not gw.decode.rec.active and not gw.prefill.rec.active)


# ---- input limits: a 400 naming the param


def _big_int(digits: int) -> bytes:
    return b'{"messages": [{"role": "user", "content": "hi"}], "n": ' + b"9" * digits + b"}"


LIMIT_CASES = [
    (CHAT, chat_body(n=5), "n"),
    (CHAT, chat_body(n=10**30), "n"),
    (CHAT, chat_body(n=-1), "n"),
    (CHAT, chat_body(logprobs=True, top_logprobs=6), "top_logprobs"),
    (COMPLETIONS, completion_body(logprobs=6), "logprobs"),
    (CHAT, chat_body(stop=["a", "b", "c", "d"]), "stop"),
    (CHAT, chat_body(stop="x" * 11), "stop"),
    (COMPLETIONS, completion_body(stop_token_ids=[1] * 1025), "stop_token_ids"),
    (COMPLETIONS, completion_body(["a"] * 3, n=2), "n"),  # 6 engine requests > queue of 5
    (COMPLETIONS, completion_body([[1]] * 6), "prompt"),
    (CHAT, chat_body(max_tokens=-5), "max_tokens"),
    (CHAT, chat_body(max_completion_tokens=5000), "max_completion_tokens"),
    (COMPLETIONS, completion_body(max_tokens=2**63), "max_tokens"),
    (CHAT, chat_body(temperature=-0.5), "temperature"),
    (CHAT, chat_body(top_k="5"), "top_k"),
    (CHAT, chat_body(stream=1), "stream"),
    (CHAT, chat_body(presence_penalty=[1]), "presence_penalty"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a"}], "top_p": Infinity}', "top_p"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a"}], "min_p": NaN}', "min_p"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a"}], "temperature": 1e999}',
     "temperature"),
    (CHAT, _big_int(4000), "n"),
    (CHAT, _big_int(5000), None),  # longer than any JSON number pydantic parses
    (CHAT, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # nesting
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),  # bad UTF-8
    (CHAT, b'"just a string"', None),
    (CHAT, b"null", None),
    (COMPLETIONS, completion_body("word " * 400_000), "prompt"),  # refused untokenized
    (CHAT, chat_body("word " * 400_000), "messages"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def limited_gateway(model_path, module_cluster):
    async with running_gateway(model_path, module_cluster, max_n=4, max_logprobs=5,
                               max_stop_strings=3, max_stop_string_length=10,
                               max_num_queued_requests=5) as gw:
        yield gw


@pytest.mark.parametrize("path,body,param", LIMIT_CASES)
async def test_every_limit_is_a_400_naming_its_param(limited_gateway, cluster, path, body,
                                                     param):
    gw = limited_gateway
    if isinstance(body, bytes):
        r = await gw.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await gw.http.post(path, json=body)
    err = assert_error_object(r, 400)
    assert err["param"] == param, err
    assert err["code"] == 400
    assert not gw.prefill.rec.requests and not gw.decode.rec.requests


async def test_body_over_the_limit_is_413_streamed_or_declared(make_gateway):
    gw = await make_gateway(max_body_size=4096)
    body = completion_body("x" * 5000)
    assert_error_object(await gw.http.post(COMPLETIONS, json=body), 413)

    async def chunks():
        for _ in range(10):
            yield b"x" * 1000

    r = await gw.http.post(COMPLETIONS, content=chunks())  # no content-length
    err = assert_error_object(r, 413)
    assert "4096" in err["message"]
    assert (await gw.http.post(CHAT, json=chat_body(max_tokens=2))).status_code == 200


# ---- /openapi.json


async def test_openapi_document(make_gateway):
    gw = await make_gateway(api_key="k")
    r = await gw.http.get("/openapi.json")  # open, as vLLM's (/docs reads it)
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    routes = {openapi_path(route.path): route.methods for route in gw.app.routes}
    assert set(doc["paths"]) == set(routes)
    for path, methods in routes.items():
        assert {m.lower() for m in methods} - {"head"} == set(doc["paths"][path]), path
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert set(op["responses"]) >= {"200", "400", "401", "413", "429", "503"}
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["type"] == "integer"
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert set(schemas["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    assert doc["paths"]["/health"]["get"]["security"] == []
    refs = {v for v in _walk(doc) if isinstance(v, str) and v.startswith("#/components/")}
    for ref in refs:  # every $ref resolves
        assert ref.rsplit("/", 1)[1] in schemas, ref


def _walk(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)
    else:
        yield node


# ---- prompt size before tokenizing; the stop table


def _hopeless_chars(gw) -> int:
    """Characters over which a prompt is refused untokenized (4 x the fake's 2048 context)."""
    return gw.app.state.gateway.completion._max_token_chars * 4 * 2048


async def test_tokenize_and_the_sum_of_prompts_are_bounded_before_tokenizing(gateway):
    """A hopeless /tokenize is a 400 (it would hold the one tokenizer thread for seconds),
    and so is a completion whose prompts are each under the bound but together over it."""
    limit = _hopeless_chars(gateway)
    text = "word " * (limit // 5 + 1)
    for body, param in (({"prompt": text}, "prompt"),
                        ({"messages": [{"role": "user", "content": text}]}, "messages")):
        err = assert_error_object(await gateway.http.post("/tokenize", json=body), 400)
        assert err["param"] == param and f"{len(text)} characters" in err["message"]
    part = "word " * (limit // 15 + 1)  # a third of the bound: 4 of them are over it
    err = assert_error_object(await gateway.http.post(COMPLETIONS, json=completion_body(
        [part] * 4, max_tokens=2)), 400)
    assert err["param"] == "prompt" and f"{4 * len(part)} characters" in err["message"]
    assert not gateway.prefill.rec.requests and not gateway.decode.rec.requests
    ok = await gateway.http.post("/tokenize", json={"prompt": " ".join(["word"] * 100)})
    assert ok.status_code == 200 and ok.json()["count"] == 100


async def test_one_stop_table_per_request_shared_by_its_choices(gateway, monkeypatch):
    """The defaults' most stop strings (32 x 512 characters), n=16: one table is built."""
    built = []

    class CountingTable(serving.StopTable):
        __slots__ = ()

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(serving, "StopTable", CountingTable)
    stop = [chr(0x4E00 + i) * 512 for i in range(31)] + ["UNO DUE TRE"]
    r = await gateway.http.post(COMPLETIONS, json=completion_body(
        n=16, max_tokens=60, temperature=0, stop=stop))
    assert r.status_code == 200, r.text
    assert len(built) == 1
    choices = r.json()["choices"]
    assert len(choices) == 16
    for c in choices:
        assert c["text"] == "Hello there! Counting: 1 2 3 4 5 6 7 8 9 10. Café 🙂 and 你好世界, "
        assert (c["finish_reason"], c["stop_reason"]) == ("stop", "UNO DUE TRE")
    await _drained(gateway)
