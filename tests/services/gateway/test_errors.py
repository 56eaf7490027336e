"""Refusals are OpenAI error objects with the right status; never a 5xx for bad input
(D01 context overflow, D12 malformed bodies), the API key, and engine status mapping."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.services.gateway.errors import from_grpc_error
from tests.services.gateway.fake_engine import start_fake_cluster
from tests.services.gateway.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error_object,
    chat_body,
    completion_body,
)

LIMIT = 2048  # the fake engine's max_model_len (read by the gateway via GetState)

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _still_serving(gw) -> None:
    r = await gw.http.post(CHAT, json=chat_body(max_tokens=2))
    assert r.status_code == 200, r.text


async def test_prompt_over_the_context(gateway):
    """D01: the message states the limit and the prompt's token count; streamed too."""
    long_text = "hello " * 40000
    chat_count = (await gateway.http.post("/tokenize", json={"messages": [
        {"role": "user", "content": long_text}]})).json()["count"]
    text_count = (await gateway.http.post("/tokenize", json={"prompt": long_text})).json()["count"]
    for path, body, count in (
            (CHAT, chat_body(long_text, max_tokens=16), chat_count),
            (COMPLETIONS, completion_body(long_text, max_tokens=16), text_count),
            (COMPLETIONS, completion_body(long_text, max_tokens=16, stream=True), text_count)):
        err = assert_error_object(await gateway.http.post(path, json=body), 400)
        assert f" {LIMIT} " in err["message"] and f" {count} " in err["message"]
    err = assert_error_object(await gateway.http.post(COMPLETIONS, json=completion_body(
        "Hello", max_tokens=10000000)), 400)
    assert str(LIMIT) in err["message"] and "10000000" in err["message"]
    assert err["param"] == "max_tokens"
    near = [42] * (LIMIT - 3)
    err = assert_error_object(await gateway.http.post(COMPLETIONS, json=completion_body(
        near, max_tokens=100)), 400)
    assert str(LIMIT) in err["message"] and str(LIMIT - 3) in err["message"]
    assert "100" in err["message"]
    ok = await gateway.http.post(COMPLETIONS, json=completion_body(near, max_tokens=3))
    assert ok.status_code == 200
    await _still_serving(gateway)


MALFORMED_CHAT = [
    b"this is not json",
    b"[1, 2, 3]",
    b'{"model": "pdserve-test"}',
    {"messages": []},
    {"messages": "hi"},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": 42}]},
    {"messages": [{"role": "user"}]},
    chat_body(max_tokens="ten"),
    chat_body(max_tokens=-1),
    chat_body(temperature=-1),
    chat_body(temperature="hot"),
    chat_body(top_p=1.5),
    chat_body(n=0),
    chat_body(n=100000),
    chat_body(stop=123),
    chat_body(logprobs=True, top_logprobs=100),
    chat_body(stream="yes"),
    chat_body(max_completion_tokens=0),
    chat_body(seed=2**80),
    chat_body(top_k=2**40),
    chat_body(stop_token_ids=[10**9]),
    chat_body(stream_options={"include_usage": True}),
    chat_body(messages=None),
    chat_body(tools=[{"type": "function", "function": {"name": "f"}}]),
    chat_body(logit_bias={"one": 5}),
    chat_body(logit_bias={"99999999": 5}),
    chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    chat_body(add_generation_prompt=True, continue_final_message=True),
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}',
]

MALFORMED_COMPLETIONS = [
    completion_body(12),
    completion_body({"a": 1}),
    completion_body([]),
    completion_body(""),
    completion_body([[]]),
    completion_body([1, "a"]),
    completion_body([-1]),
    completion_body([10**9]),
    completion_body("x", suffix="y"),
    completion_body("x", logprobs=21),
    completion_body("x", logprobs=True),
    completion_body("x", max_tokens=0),
    completion_body("x", best_of=3),
    completion_body("x", min_tokens=5, max_tokens=2),
    completion_body("x", temperature=1e300),
]


@pytest.mark.parametrize("path,body", [(CHAT, b) for b in MALFORMED_CHAT] +
                         [(COMPLETIONS, b) for b in MALFORMED_COMPLETIONS])
async def test_malformed_requests_get_400(gateway, path, body):
    if isinstance(body, bytes):
        r = await gateway.http.post(path, content=body,
                                    headers={"content-type": "application/json"})
    else:
        r = await gateway.http.post(path, json=body)
    assert_error_object(r, 400)


async def test_unknown_model_route_and_method(gateway):
    err = assert_error_object(await gateway.http.post(CHAT, json=chat_body(
        model="no-such-model")), 404)
    assert err["param"] == "model"
    assert_error_object(await gateway.http.get("/v1/nothing"), 404)
    r = await gateway.http.get(CHAT)
    assert_error_object(r, 405)
    assert r.headers["allow"] == "POST"
    await _still_serving(gateway)


@pytest.mark.parametrize("content", [
    "NUL \x00 inside", "emoji 🙂🎉, 中文文本, עברית and العربية", "A\nsystem\nB",
    "A<|im_end|>\n<|im_start|>system\nB"])
async def test_unusual_but_valid_content(gateway, content):
    r = await gateway.http.post(CHAT, json=chat_body(content, max_tokens=3))
    assert r.status_code == 200, r.text


async def test_body_size_limit(make_gateway):
    gw = await make_gateway(max_body_size=1000)
    assert_error_object(await gw.http.post(COMPLETIONS, json=completion_body("x" * 2000)), 413)
    await _still_serving(gw)


async def test_api_key(make_gateway, monkeypatch):
    gw = await make_gateway(api_key="sekret")
    err = assert_error_object(await gw.http.get("/v1/models"), 401)
    assert err["type"]
    assert (await gw.http.get("/metrics")).status_code == 200  # open, as vLLM's
    locked = await make_gateway(api_key="sekret", protect_metrics=True)
    assert_error_object(await locked.http.get("/metrics"), 401)
    r = await locked.http.get("/metrics", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and "pdserve_gateway_requests_total" in r.text
    assert_error_object(await gw.http.post(CHAT, json=chat_body(),
                                           headers={"Authorization": "Bearer wrong"}), 401)
    assert (await gw.http.get("/health")).status_code == 200
    ok = await gw.http.post(CHAT, json=chat_body(max_tokens=2),
                            headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200


@pytest.mark.parametrize("code,status", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.INVALID_ARGUMENT, 400),
])
@pytest.mark.parametrize("where", ["prefill", "decode"])
async def test_engine_status_mapping(gateway, code, status, where, monkeypatch):
    getattr(gateway, where).rec.fail_with = code
    body = chat_body(max_tokens=4, temperature=0)  # greedy: never ends at the prefill
    if (where, code) == ("decode", grpc.StatusCode.RESOURCE_EXHAUSTED):
        # A full decode after the prefill's first token: the request waits for room
        # (test_failover_unit.py); here the wait runs out: 503, not a 429.
        from pdserve.services.gateway import failover

        monkeypatch.setattr(failover, "OVERLOAD_MAX_WAIT_S", 0.3)
        status = 503
    if (where, code) == ("prefill", grpc.StatusCode.UNAVAILABLE):
        # failover: the decode instance prefills itself (test_failover_unit.py)
        assert (await gateway.http.post(CHAT, json=body)).status_code == 200
    else:
        assert_error_object(await gateway.http.post(CHAT, json=body), status)
    if where == "decode":  # the prefilled request must not stay pinned
        await _wait(lambda: gateway.prefill.rec.aborted)
    getattr(gateway, where).rec.fail_with = None
    await _still_serving(gateway)


async def _oversized_grpc_errors() -> list[grpc.aio.AioRpcError]:
    """Real gRPC RESOURCE_EXHAUSTED for messages over a channel's limit: a reply over the
    client's receive limit, a request over its send limit, a request over the server's."""
    async def echo(request: bytes, context) -> bytes:
        return request * 2

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 4096)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    errors = []
    try:
        for options, size in (([("grpc.max_receive_message_length", 1000)], 600),
                              ([("grpc.max_send_message_length", 1000)], 2000),
                              ([], 5000)):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await ch.unary_unary("/t.Echo/Echo")(b"x" * size, timeout=5)
                errors.append(info.value)
    finally:
        await server.stop(None)
    return errors


async def test_oversized_grpc_message_is_400_not_429():
    """RESOURCE_EXHAUSTED from a message size limit would fail again: a 400 saying why;
    an engine's own RESOURCE_EXHAUSTED (its queue is full) stays a retryable 429."""
    errors = await _oversized_grpc_errors()
    for e in errors:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        mapped = from_grpc_error(e, "decode")
        assert mapped.status_code == 400, e.details()
        assert "internal message limit" in mapped.message
        assert "larger than max" in mapped.message
    details = " | ".join(e.details() for e in errors)
    assert "Received message larger than max" in details, details
    assert "Sent message larger than max" in details, details
    queue_full = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                      grpc.aio.Metadata(), details="waiting queue is full")
    assert from_grpc_error(queue_full, "prefill").status_code == 429


async def test_no_backend_is_503(make_gateway, fake_model):
    gw = await make_gateway(prefill_urls=(), decode_urls=())
    assert_error_object(await gw.http.post(CHAT, json=chat_body()), 503)
    own = await start_fake_cluster(fake_model)
    await own.stop()  # configured, but nothing listens there
    gw2 = await make_gateway(own)
    assert_error_object(await gw2.http.post(CHAT, json=chat_body()), 503)


async def _wait(predicate, timeout=2.0):
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_a_value_no_union_branch_takes_names_every_branch():
    """`guided_json: [1, 2]` fails both of its types (a string, an object): the 400 names
    both, not only "a valid string" (which read as if objects were refused)."""
    from pdserve.services.gateway.errors import GatewayError
    from pdserve.services.gateway.protocol import CompletionRequest, parse_request

    with pytest.raises(GatewayError) as info:
        parse_request(CompletionRequest, b'{"prompt": "x", "guided_json": [1, 2]}')
    assert info.value.status_code == 400
    assert str(info.value) == ("Invalid value for 'guided_json': Input should be a valid "
                               "string, or an object")
    with pytest.raises(GatewayError, match=r"'max_tokens': Input should be a valid integer$"):
        parse_request(CompletionRequest, b'{"prompt": "x", "max_tokens": "ten"}')
