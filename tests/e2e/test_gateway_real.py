"""End-to-end: the real gateway (uvicorn, official `openai` client) in front of real prefill
and decode services (issue 4's acceptance): offline parity, D11 batch invariance, D10
disconnect cleanup, cached_tokens, a malformed request; and (issue 6) overload at 4x
the queue on real engines."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import openai
import pytest

from tests.e2e.conftest import PARITY_CASES, PARITY_MAX_TOKENS, Urls
from tests.services.gateway.conftest import SERVED_MODEL, running_gateway
from tests.services.helpers import get_states, wait_leak_free

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

WORDS = ("river mountain lantern violet copper harbor meadow silent orange falcon thunder "
         "garden pencil winter marble candle shadow forest bridge ocean velvet engine "
         "planet whisper ladder compass saddle mirror basket cobalt tunnel village").split()


def filler(tokenizer, n_tokens: int, seed: int) -> str:
    """Text of about `n_tokens` tokens (exact after the gateway's re-tokenization +- 1)."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
    ids = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


async def chat(client, messages, max_tokens, **kw):
    return await client.chat.completions.create(model=SERVED_MODEL, messages=messages,
                                                max_tokens=max_tokens, temperature=0, **kw)


async def chat_streamed(client, messages, max_tokens) -> tuple[str, int, str | None]:
    stream = await client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    text, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert usage is not None
    return "".join(text), usage.completion_tokens, finish


async def test_greedy_chat_equals_offline_llm(real_gateway, offline_answers):
    client = real_gateway.client
    for messages, ref in zip(PARITY_CASES, offline_answers, strict=True):
        resp = await chat(client, messages, PARITY_MAX_TOKENS)
        choice = resp.choices[0]
        assert choice.message.content == ref.text
        assert resp.usage.completion_tokens == len(ref.token_ids)
        assert choice.finish_reason == ref.finish_reason
        text, n, finish = await chat_streamed(client, messages, PARITY_MAX_TOKENS)
        assert (text, n, finish) == (ref.text, len(ref.token_ids), ref.finish_reason)


SWIM = [{"role": "user", "content": "Give three reasons to learn to swim."}]


async def test_d11_greedy_answer_independent_of_batch(real_gateway, tokenizer):
    client = real_gateway.client

    def key(resp):
        return (resp.choices[0].message.content, resp.usage.completion_tokens,
                resp.choices[0].finish_reason)

    alone = key(await chat(client, SWIM, 64))
    assert alone[0] and alone[1] > 0

    copies = await asyncio.gather(*(chat(client, SWIM, 64) for _ in range(8)))
    assert [key(r) for r in copies] == [alone] * 8

    lengths = [3, 10, 30, 80, 200, 400, 800, 1500]
    others = [[{"role": "user", "content": filler(tokenizer, n, seed=n)}] for n in lengths]
    tasks = [chat(client, SWIM, 64) for _ in range(8)]
    tasks += [chat(client, m, 16) for m in others]
    order = list(range(16))
    random.Random(0).shuffle(order)  # interleave copies and others as they are sent
    shuffled = await asyncio.gather(*(tasks[i] for i in order))
    results = [None] * 16
    for pos, i in enumerate(order):
        results[i] = shuffled[pos]
    assert [key(r) for r in results[:8]] == [alone] * 8
    # the others really were long: the longest prompt is about 1,500 tokens
    assert max(r.usage.prompt_tokens for r in results[8:]) >= 1500


def idle(state, baseline) -> bool:
    return (state.num_running == 0 and state.num_waiting == 0
            and state.num_used_blocks <= baseline.num_used_blocks
            and state.num_pinned_blocks <= baseline.num_pinned_blocks)


async def test_d10_disconnect_frees_both_services(real_gateway, real_cluster, tokenizer):
    client = real_gateway.client
    baseline = await get_states(real_cluster)
    assert all(s.invariants_ok for s in baseline), [s.invariants_error for s in baseline]

    async def open_and_read_one(i):
        # max_tokens 1800, not 2000: a ~200-token prompt + 2000 is over max_model_len 2048
        stream = await client.completions.create(
            model=SERVED_MODEL, prompt=filler(tokenizer, 200, seed=1000 + i), max_tokens=1800,
            temperature=0.8, stream=True)
        async for _ in stream:
            break
        return stream

    streams = await asyncio.gather(*(open_and_read_one(i) for i in range(8)))
    try:
        during = await get_states(real_cluster)
        # Really still generating: the first token comes from the prefill, so the decode
        # may still be fetching the KV (its blocks held, the requests not yet scheduled).
        assert (during[1].num_running + during[1].num_waiting > 0
                or during[1].num_used_blocks > baseline[1].num_used_blocks), during[1]
    finally:  # never leave 8 streams of 1800 tokens running into the next test
        for s in streams:
            await s.close()
    t0 = time.monotonic()
    while True:
        states = await get_states(real_cluster)
        elapsed = time.monotonic() - t0
        if all(idle(s, b) for s, b in zip(states, baseline, strict=True)) or elapsed > 5:
            break
        await asyncio.sleep(0.02)
    assert all(idle(s, b) for s, b in zip(states, baseline, strict=True)), states
    assert all(s.invariants_ok for s in states), states
    print(f"\nd10: both services idle {elapsed:.2f} s after the clients left")

    probe = await client.completions.create(model=SERVED_MODEL,
                                            prompt="The capital of France is",
                                            max_tokens=8, temperature=0)
    assert probe.usage.completion_tokens == 8 or probe.choices[0].finish_reason == "stop"
    assert probe.choices[0].text


async def test_a_request_finished_at_prefill_leaves_no_block_held(real_gateway, real_cluster):
    """max_tokens 1: the prefill instance answers with the finish and has freed the blocks
    itself (the gateway sends no ReleaseKV): right after the answer, nothing is pinned or in
    use beyond the baseline on either instance."""
    baseline = await get_states(real_cluster)
    resp = await chat(real_gateway.client, SWIM, 1)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 1
    states = await get_states(real_cluster)  # no polling: freed before Prefill answered
    assert all(idle(s, b) for s, b in zip(states, baseline, strict=True)), states
    assert states[0].num_pinned_blocks == 0 and states[0].invariants_ok, states[0]


async def test_stop_reason_is_the_engines(real_gateway, offline_answers, tokenizer):
    """stop_token_ids end a greedy answer on that token with stop_reason = its id, whether the
    prefill's first token (PrefillResponse) or a decode's (TokenChunk) stops it."""
    ids = offline_answers[0].token_ids
    for at in (0, ids.index(ids[5])):  # where that token first comes
        got = await chat(real_gateway.client, PARITY_CASES[0], PARITY_MAX_TOKENS,
                         extra_body={"stop_token_ids": [ids[at]]})
        choice = got.choices[0]
        assert (choice.finish_reason, choice.stop_reason) == ("stop", ids[at])
        assert got.usage.completion_tokens == at + 1
        assert choice.message.content == tokenizer.decode(ids[:at], skip_special_tokens=True)


async def test_usage_reports_cached_tokens(real_gateway, tokenizer):
    client = real_gateway.client
    prompt = filler(tokenizer, 410, seed=4242)
    first = await client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=4,
                                            temperature=0)
    second = await client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=4,
                                             temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens >= 400
    first_cached = (first.usage.prompt_tokens_details.cached_tokens
                    if first.usage.prompt_tokens_details else 0)
    assert (first_cached or 0) < 16
    assert second.usage.prompt_tokens_details.cached_tokens >= 384
    assert second.choices[0].text == first.choices[0].text


async def test_malformed_request_gets_400_then_service_works(real_gateway):
    client = real_gateway.client
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=SERVED_MODEL, prompt="Hello", max_tokens=-1)
    assert info.value.status_code == 400
    body = info.value.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert body["error"]["message"]
    r = await real_gateway.http.post("/v1/chat/completions", json={
        "model": SERVED_MODEL, "messages": SWIM, "max_tokens": "many"})
    assert r.status_code == 400 and "error" in r.json()
    ok = await chat(client, SWIM, 8)
    assert ok.choices[0].message.content and ok.usage.completion_tokens == 8


async def test_priority_without_the_priority_policy_is_a_400_naming_it(real_gateway):
    """vLLM's `priority` reaches the engines, which refuse it under the default policy."""
    client = real_gateway.client
    for extra in ({"priority": 2}, {"priority": -1}):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=SERVED_MODEL, messages=SWIM,
                                                 max_tokens=4, extra_body=extra)
        body = info.value.response.json()["error"]
        assert "priority scheduling is not enabled" in body["message"], body
    ok = await client.chat.completions.create(model=SERVED_MODEL, messages=SWIM, max_tokens=4,
                                              extra_body={"priority": 0})
    assert ok.usage.completion_tokens == 4


async def test_overload_on_real_engines_429_then_all_complete(model_path, real_cluster):
    """Issue 6 at 4x overload on REAL engines: a gateway with a queue of 4 gets 16 streams at
    once; the excess answers 429 + Retry-After, every accepted stream completes with the
    undisturbed greedy answer, /health answers within 1 s throughout, nothing leaks."""
    queue, clients, bound = 4, 16, 1.0
    urls = Urls((real_cluster.prefill.identity.address,),
                (real_cluster.decode.identity.address,))
    body = {"model": SERVED_MODEL, "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    async with running_gateway(model_path, urls, rpc_timeout=10.0,  # type: ignore[arg-type]
                               max_num_queued_requests=queue) as gw:
        reference = (await gw.http.post("/v1/completions", json=body, timeout=120)).json()
        want = reference["choices"][0]["text"]
        worst, polls, stop = [0.0], [0], threading.Event()

        def probe() -> None:
            import httpx
  # its own thread and client: measures what a prober sees
            with httpx.Client(base_url=gw.url, timeout=5) as c:
                while not stop.is_set():
                    t0 = time.monotonic()
                    assert c.get("/health").status_code == 200
                    worst[0] = max(worst[0], time.monotonic() - t0)
                    polls[0] += 1
                    stop.wait(0.1)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()

        async def one() -> tuple[int, str | None, str]:
            async with gw.http.stream("POST", "/v1/completions", timeout=120,
                                      json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    return r.status_code, r.headers.get("retry-after"), (await r.aread()).decode()
                text = ""
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        text += chunk["choices"][0]["text"] if chunk["choices"] else ""
                return 200, None, text

        try:
            results = await asyncio.gather(*(one() for _ in range(clients)))
        finally:
            stop.set()
            prober.join(10)
    accepted = [t for s, _, t in results if s == 200]
    refused = [(s, ra, t) for s, ra, t in results if s != 200]
    print(f"\noverload(real): clients={clients} queue={queue} accepted={len(accepted)} "
          f"429={len(refused)} health_polls={polls[0]} health_worst={worst[0]:.3f}s")
    assert refused and all(s == 429 and ra and int(ra) >= 1 and '"error"' in t
                           for s, ra, t in refused), refused
    assert queue <= len(accepted) < clients
    assert all(t == want for t in accepted)
    assert polls[0] >= 3 and worst[0] < bound
    states = await wait_leak_free(real_cluster, timeout=30)
    assert all(s.num_used_blocks == 0 and s.num_pinned_blocks == 0 and s.invariants_ok
               for s in states), states
