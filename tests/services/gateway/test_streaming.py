"""SSE framing, [DONE], usage in streams (D04), several choices in one stream (D05),
plain JSON errors for streamed requests, and aborts when the client leaves (D10's class)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from tests.services.gateway.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error_object,
    chat_body,
    completion_body,
    finish_reasons,
    stream,
    streamed_texts,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.mark.parametrize("path,body", [
    (CHAT, chat_body("Write a haiku about rain.", max_tokens=20, temperature=0)),
    (COMPLETIONS, completion_body("Once upon a time", max_tokens=20, temperature=0)),
])
async def test_stream_matches_non_streamed_and_follows_chunk_schema(gateway, path, body):
    chat = path == CHAT
    chunks = await stream(gateway.http, path, body)
    full = (await gateway.http.post(path, json=body)).json()
    expected = full["choices"][0]["message"]["content"] if chat else full["choices"][0]["text"]
    assert streamed_texts(chunks, chat) == {0: expected}
    assert finish_reasons(chunks) == {0: [full["choices"][0]["finish_reason"]]}
    assert len({c["id"] for c in chunks}) == 1
    for c in chunks:
        assert c["object"] == ("chat.completion.chunk" if chat else "text_completion")
        assert isinstance(c["created"], int) and c["model"] == body["model"]
        assert "usage" not in c or c["usage"] is None
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("n", [1, 2])
async def test_usage_chunk_rules(gateway, n):
    body = chat_body("Write a haiku about rain.", max_tokens=20, n=n,
                     **({"temperature": 0} if n == 1 else
                        {"temperature": 0.8, "seed": 7, "ignore_eos": True}))
    chunks = await stream(gateway.http, CHAT, {**body, "stream_options": {"include_usage": True}})
    with_usage = [c for c in chunks if c.get("usage") is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    full = (await gateway.http.post(CHAT, json=body)).json()["usage"]
    assert usage["prompt_tokens"] == full["prompt_tokens"]
    assert usage["completion_tokens"] == full["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert all(isinstance(v, int) for k, v in usage.items() if k != "prompt_tokens_details")
    assert n == 1 or usage["completion_tokens"] == 2 * 20  # summed over both choices
    no_opts = await stream(gateway.http, CHAT, body)
    assert all(c.get("usage") is None for c in no_opts)


@pytest.mark.parametrize("path,body", [
    (CHAT, chat_body("Name a colour and say why you like it.")),
    (COMPLETIONS, completion_body("My favourite colour is")),
])
async def test_several_choices_in_one_stream(gateway, path, body):
    body = {**body, "n": 3, "max_tokens": 16, "temperature": 1.0}
    chunks = await stream(gateway.http, path, body)
    assert len({c["id"] for c in chunks}) == 1
    seen_finish: set[int] = set()
    for c in chunks:
        for ch in c["choices"]:
            assert ch["index"] in (0, 1, 2)
            text = (ch["delta"].get("content") if path == CHAT else ch["text"]) or ""
            assert not (ch["index"] in seen_finish and text), "text after finish_reason"
            if ch["finish_reason"] is not None:
                assert ch["finish_reason"] in ("stop", "length")
                seen_finish.add(ch["index"])
    assert {i: len(f) for i, f in finish_reasons(chunks).items()} == {0: 1, 1: 1, 2: 1}
    texts = streamed_texts(chunks, path == CHAT)
    assert len(set(texts.values())) > 1  # three independent samples
    single = await stream(gateway.http, path, {**body, "n": 1})
    assert {ch["index"] for c in single for ch in c["choices"]} == {0}


async def test_seeded_choices_are_reproducible(gateway):
    body = chat_body("Hi", n=2, temperature=0.8, seed=7, max_tokens=10)
    a = (await gateway.http.post(CHAT, json=body)).json()
    b = streamed_texts(await stream(gateway.http, CHAT, body), chat=True)
    assert {c["index"]: c["message"]["content"] for c in a["choices"]} == b
    seeds = [r.sampling_params.seed for r in gateway.prefill.rec.requests[-2:]]
    assert sorted(seeds) == [7, 8]  # seed + i per choice


async def test_streamed_validation_error_is_plain_json(gateway):
    r = await gateway.http.post(COMPLETIONS, json=completion_body(
        "hello " * 4000, stream=True, max_tokens=16))
    assert_error_object(r, 400)


async def test_streamed_overload_is_plain_json_429(gateway):
    gateway.prefill.rec.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
    r = await gateway.http.post(CHAT, json=chat_body(stream=True))
    assert_error_object(r, 429)


async def _wait_for(predicate, timeout=2.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_client_closing_a_stream_aborts_both_instances(gateway):
    gateway.decode.rec.delay = 0.02
    body = completion_body("The capital of France is", max_tokens=1000, temperature=0.8,
                           ignore_eos=True, stream=True)
    async with gateway.http.stream("POST", COMPLETIONS, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                break
    engine_id = gateway.decode.rec.requests[-1].request_id
    t0 = asyncio.get_running_loop().time()
    await _wait_for(lambda: engine_id in gateway.decode.rec.cancelled, timeout=1.0)
    await _wait_for(lambda: engine_id in gateway.decode.rec.aborted
                    and engine_id in gateway.prefill.rec.aborted, timeout=1.0)
    assert asyncio.get_running_loop().time() - t0 < 1.0
    assert not gateway.decode.rec.active
    r = await gateway.http.post(CHAT, json=chat_body(max_tokens=3))  # still serving
    assert r.status_code == 200


async def test_client_timeout_on_non_streamed_request_aborts(gateway):
    gateway.decode.rec.delay = 0.02
    body = chat_body(max_tokens=1000, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        await gateway.http.post(CHAT, json=body, timeout=0.4)
    await _wait_for(lambda: gateway.decode.rec.cancelled and gateway.decode.rec.aborted)
    assert gateway.decode.rec.cancelled[0] == gateway.decode.rec.aborted[0]
    assert gateway.prefill.rec.aborted == gateway.decode.rec.aborted
    await _wait_for(lambda: not gateway.decode.rec.active)


async def test_client_leaving_during_prefill_aborts_the_prefill(gateway):
    gateway.prefill.rec.delay = 5.0
    with pytest.raises(httpx.ReadTimeout):
        await gateway.http.post(CHAT, json=chat_body(stream=True), timeout=0.3)
    await _wait_for(lambda: gateway.prefill.rec.cancelled and gateway.prefill.rec.aborted)
    assert not gateway.decode.rec.requests


async def test_openai_client_streams(gateway):
    stream_ = await gateway.client.chat.completions.create(
        model="pdserve-test", messages=[{"role": "user", "content": "Hi"}], temperature=0,
        stream=True, stream_options={"include_usage": True}, max_tokens=12)
    text, usage, finish = "", None, None
    async for chunk in stream_:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert finish == "length" and usage.completion_tokens == 12 and text
    comp = await gateway.client.completions.create(model="pdserve-test", prompt="Hi",
                                                   max_tokens=5, temperature=0, stream=True)
    pieces = [c.choices[0].text async for c in comp]
    assert "".join(pieces) == text[:len("".join(pieces))]


async def test_the_end_of_the_grace_period_cuts_what_still_runs(make_gateway, cluster):
    """Shutdown: what still runs when the grace period ends is told so. A stream gets an
    error event (type server_shutdown) and [DONE] after the tokens it had; a non-streamed
    request a 503 with that error; both engine requests are cancelled."""
    from tests.services.gateway.helpers import parse_sse

    gw = await make_gateway()
    cluster.decodes[0].rec.delay = 0.05
    body = chat_body("Tell a long story.", max_tokens=500, ignore_eos=True)
    streamed = asyncio.ensure_future(gw.http.post(CHAT, json={**body, "stream": True}))
    plain = asyncio.ensure_future(gw.http.post(CHAT, json=body))
    while len(cluster.decodes[0].rec.active) < 2:
        await asyncio.sleep(0.02)
    gw.app.state.gateway.shutdown.begin(0.3)
    r = await streamed
    events = parse_sse(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert (error["type"], error["code"]) == ("server_shutdown", 503), error
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in events[:-2])
    err = assert_error_object(await plain, 503)
    assert err["type"] == "server_shutdown"
    for _ in range(100):
        if not cluster.decodes[0].rec.active:
            break
        await asyncio.sleep(0.02)
    assert not cluster.decodes[0].rec.active
    assert len(cluster.decodes[0].rec.cancelled) == 2


@pytest.mark.parametrize("path,body", [
    (CHAT, chat_body("Write a haiku about rain.", max_tokens=12, temperature=0)),
    (COMPLETIONS, completion_body("Once upon a time", max_tokens=12, temperature=0)),
])
async def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(gateway, path,
                                                                           body):
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): every chunk
    carries the usage so far; the last (usage-only) chunk the final one."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await stream(gateway.http, path, {**body, "stream_options": options})
    full = (await gateway.http.post(path, json=body)).json()["usage"]
    assert all(c.get("usage") is not None for c in chunks), chunks
    generated = [c["usage"]["completion_tokens"] for c in chunks]
    assert generated == sorted(generated) and generated[-1] == full["completion_tokens"]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {full["prompt_tokens"]}
    assert chunks[-1]["choices"] == [] and generated[-2] == generated[-1]
    # continuous_usage_stats alone (no include_usage) adds nothing, as in vLLM
    plain = await stream(gateway.http, path,
                         {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all(c.get("usage") is None for c in plain)


async def test_null_means_the_default_as_in_the_openai_api(gateway):
    """`"n": null`, `"logprobs": null`, `"echo": null` ... are the defaults (OpenAI's API
    allows null; vLLM's fields are Optional), not 400s."""
    chat = chat_body("Write a haiku about rain.", max_tokens=8, temperature=0)
    want = (await gateway.http.post(CHAT, json=chat)).json()
    got = await gateway.http.post(CHAT, json={**chat, "n": None, "logprobs": None,
                                              "echo": None, "ignore_eos": None})
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == want["choices"]
    comp = completion_body("Once upon a time", max_tokens=8, temperature=0)
    want = (await gateway.http.post(COMPLETIONS, json=comp)).json()
    got = await gateway.http.post(COMPLETIONS, json={**comp, "echo": None, "n": None,
                                                     "min_tokens": None})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
    # a required field's null is still an error
    bad = await gateway.http.post(COMPLETIONS, json={**comp, "prompt": None})
    assert bad.status_code == 400, bad.text
