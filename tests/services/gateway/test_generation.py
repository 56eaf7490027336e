"""Generation semantics through the gateway: stop strings (D03, D06), exact lengths (D07),
logprob shapes (D08), schema (D09), echo (D02), finish reasons and token accounting."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.services.gateway.helpers import (
    CHAT,
    COMPLETIONS,
    chat_body,
    completion_body,
    finish_reasons,
    stream,
    streamed_texts,
)

MARKERS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _text(resp: dict, chat: bool) -> str:
    c = resp["choices"][0]
    return c["message"]["content"] if chat else c["text"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("tokens_per_chunk", [1, 3])
async def test_held_back_text_is_flushed_at_length(gateway, chat, tokens_per_chunk):
    """D03: a stop string that starts matching at the very end but never completes."""
    gateway.decode.tokens_per_chunk = tokens_per_chunk
    path = CHAT if chat else COMPLETIONS
    base = (chat_body("Repeat exactly: UNO DUE TRE") if chat
            else completion_body("Repeat exactly: UNO DUE TRE"))
    base = {**base, "temperature": 0, "max_tokens": 24}
    ref = (await gateway.http.post(path, json=base)).json()
    r_text, r_finish = _text(ref, chat), ref["choices"][0]["finish_reason"]
    body = {**base, "stop": [r_text[-3:] + "\nAAAAAAAA"]}
    assert streamed_texts(await stream(gateway.http, path, body), chat) == {0: r_text}
    assert finish_reasons(await stream(gateway.http, path, body)) == {0: [r_finish]}
    plain = (await gateway.http.post(path, json=body)).json()
    assert _text(plain, chat) == r_text and plain["choices"][0]["finish_reason"] == r_finish


@pytest.mark.parametrize("tokens_per_chunk", [1, 4])
async def test_stop_string_and_markers_never_in_output(gateway, tokens_per_chunk):
    """D06: output ends before the first stop string; no end-of-turn markers anywhere."""
    gateway.decode.tokens_per_chunk = tokens_per_chunk
    body = {"model": "pdserve-test", "temperature": 0, "max_tokens": 60, "messages": [
        {"role": "system", "content": "You follow instructions."},
        {"role": "user", "content": "Count from 1 to 10, separated by spaces."}]}
    ref = (await gateway.http.post(CHAT, json=body)).json()
    reference = _text(ref, True)
    assert ref["choices"][0]["finish_reason"] == "stop"  # ended on its own (EOS)
    assert "7" in reference
    gateway.decode.rec.delay = 0.005  # the engine is still generating when "7" appears
    stopped = (await gateway.http.post(CHAT, json={**body, "stop": ["7"]})).json()
    assert _text(stopped, True) == reference[:reference.index("7")]
    # A stop string ends the engine request too (cancelled stream + Abort).
    engine_id = gateway.decode.rec.requests[-1].request_id
    for _ in range(200):
        if engine_id in gateway.decode.rec.aborted and engine_id in gateway.decode.rec.cancelled:
            break
        await asyncio.sleep(0.01)
    assert engine_id in gateway.decode.rec.aborted and engine_id in gateway.decode.rec.cancelled
    assert stopped["choices"][0]["finish_reason"] == "stop"
    streamed = await stream(gateway.http, CHAT, {**body, "stop": ["7"]})
    assert streamed_texts(streamed, True) == {0: _text(stopped, True)}
    for text in (reference, _text(stopped, True), streamed_texts(streamed, True)[0]):
        assert not any(m in text for m in MARKERS)
    # The tokens up to the one completing "7" count; later ones were never generated.
    assert stopped["usage"]["completion_tokens"] < ref["usage"]["completion_tokens"]


async def test_include_stop_str_and_stop_token_ids(gateway, fast_tokenizer, fake_model):
    body = completion_body("x", temperature=0, max_tokens=60)
    ref = _text((await gateway.http.post(COMPLETIONS, json=body)).json(), False)
    inc = (await gateway.http.post(COMPLETIONS, json={
        **body, "stop": ["7"], "include_stop_str_in_output": True})).json()
    assert _text(inc, False) == ref[:ref.index("7") + 1]
    assert inc["choices"][0]["stop_reason"] == "7"
    at = next(i for i, t in enumerate(fake_model.script) if "5" in fast_tokenizer.decode([t]))
    stop_id = fake_model.script[at]
    by_id = (await gateway.http.post(COMPLETIONS, json={**body, "stop_token_ids": [stop_id]}))
    choice = by_id.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    # The stop token's own text is not emitted.
    assert choice["text"] == fast_tokenizer.decode(fake_model.script[:at])
    # EOS also listed in stop_token_ids: EOS is checked first (vLLM's order), so the engine
    # says stop_reason None, and the gateway passes that on instead of guessing.
    eos = (await gateway.http.post(COMPLETIONS, json={
        **body, "stop_token_ids": [fake_model.eos_token_id]})).json()["choices"][0]
    assert (eos["finish_reason"], eos["stop_reason"]) == ("stop", None)
    assert eos["text"] == fast_tokenizer.decode(fake_model.script[:-1])


async def test_min_tokens_suppresses_early_stop(gateway):
    body = completion_body("x", temperature=0, max_tokens=60, stop=["1"], min_tokens=8)
    text = _text((await gateway.http.post(COMPLETIONS, json=body)).json(), False)
    assert "1" in text  # the early "1" was before min_tokens; a later one stopped it


async def test_exact_token_limits(gateway):
    """D07: completion_tokens == max_tokens, as many logprobs, finish "length"."""
    for max_tokens in (1, 5):
        body = completion_body("I believe the meaning of life is", temperature=0,
                               max_tokens=max_tokens, logprobs=2)
        r = (await gateway.http.post(COMPLETIONS, json=body)).json()
        assert r["usage"]["completion_tokens"] == max_tokens
        assert len(r["choices"][0]["logprobs"]["tokens"]) == max_tokens
        assert r["choices"][0]["finish_reason"] == "length"
        chunks = await stream(gateway.http, COMPLETIONS, body)
        assert streamed_texts(chunks, False) == {0: r["choices"][0]["text"]}
        assert finish_reasons(chunks) == {0: ["length"]}
    r = (await gateway.http.post(CHAT, json=chat_body("Tell me a long story about a dragon.",
                                                       max_tokens=1, temperature=0))).json()
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "length"
    r = (await gateway.http.post(CHAT, json=chat_body("Say hi.", max_tokens=200))).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < 200


async def test_max_tokens_one_is_served_by_the_prefill_alone(gateway):
    r = await gateway.http.post(CHAT, json=chat_body(max_tokens=1))
    assert r.status_code == 200
    assert not gateway.decode.rec.requests  # finished at prefill: no decode call
    # ... and no ReleaseKV: the prefill instance freed the blocks itself (a real one:
    # tests/services/test_disaggregated.py::test_first_token_can_finish_the_request).
    await asyncio.sleep(0.2)
    assert gateway.prefill.rec.released == [] and not gateway.prefill.rec.aborted


async def test_chat_logprobs_shape(gateway):
    """D08 (chat): one entry per token, bytes of the token, three sorted alternatives."""
    body = chat_body("What is the capital of France? Answer in one sentence.",
                     temperature=0, logprobs=True, top_logprobs=3, max_tokens=12)
    r = (await gateway.http.post(CHAT, json=body)).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    tops = []
    for entry in content:
        assert entry["logprob"] <= 0
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        alts = entry["top_logprobs"]
        assert len(alts) == 3
        assert [a["logprob"] for a in alts] == sorted((a["logprob"] for a in alts), reverse=True)
        assert alts[0]["token"] == entry["token"]
        assert math.isclose(alts[0]["logprob"], entry["logprob"], abs_tol=1e-4)
        tops.append(tuple(a["token"] for a in alts))
    assert len(set(tops)) > 1
    chunks = await stream(gateway.http, CHAT, body)
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"]
                for e in ch["logprobs"]["content"]]
    assert streamed == content


async def test_completion_logprobs_shape(gateway):
    """D08 (completions): aligned lists, chosen token in each map, offsets from the prompt."""
    prompt = "The capital of France is"
    body = completion_body(prompt, temperature=0, logprobs=3, max_tokens=8)
    r = (await gateway.http.post(COMPLETIONS, json=body)).json()
    lp = r["choices"][0]["logprobs"]
    n = r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == \
        len(lp["text_offset"]) == n
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert 3 <= len(top) <= 4 and token in top
    assert lp["text_offset"][0] == len(prompt)
    assert all(b > a for a, b in zip(lp["text_offset"], lp["text_offset"][1:]))
    chunks = await stream(gateway.http, COMPLETIONS, body)
    offsets = [o for c in chunks for ch in c["choices"] if ch["logprobs"]
               for o in ch["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]


@pytest.mark.parametrize("path,body", [
    (CHAT, chat_body("Say hi.", temperature=0, max_tokens=200)),
    (COMPLETIONS, completion_body("Q: What is 2+2?\nA:", temperature=0, max_tokens=200)),
])
async def test_response_schema(gateway, path, body):
    """D09, checked by the official client's models too."""
    r = (await gateway.http.post(path, json=body)).json()
    chat = path == CHAT
    assert r["object"] == ("chat.completion" if chat else "text_completion")
    assert isinstance(r["id"], str) and isinstance(r["created"], int)
    assert r["model"] == body["model"]
    assert r["choices"][0]["finish_reason"] == "stop"
    if chat:
        assert r["choices"][0]["message"]["role"] == "assistant"
    assert all(isinstance(r["usage"][k], int)
               for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    if chat:
        parsed = await gateway.client.chat.completions.create(**body)
        assert parsed.choices[0].message.content == r["choices"][0]["message"]["content"]
    else:
        parsed = await gateway.client.completions.create(**body)
        assert parsed.choices[0].text == r["choices"][0]["text"]
    assert isinstance(parsed.usage.prompt_tokens_details.cached_tokens, int)


async def test_echo(gateway):
    """D02: echo with zero new tokens returns the prompt (with logprobs: see
    test_echo_logprobs.py)."""
    prompt = "Your answer: Yes"
    r = (await gateway.http.post(COMPLETIONS, json=completion_body(
        prompt, echo=True, max_tokens=0, temperature=0))).json()
    assert r["choices"][0]["text"] == prompt
    assert r["usage"]["completion_tokens"] == 0 and r["choices"][0]["finish_reason"] == "length"
    chunks = await stream(gateway.http, COMPLETIONS, completion_body(
        prompt, echo=True, max_tokens=0))
    assert streamed_texts(chunks, False) == {0: prompt}
    r = (await gateway.http.post(COMPLETIONS, json=completion_body(
        prompt, echo=True, max_tokens=5, temperature=0))).json()
    assert r["choices"][0]["text"].startswith(prompt) and r["usage"]["completion_tokens"] <= 5
    chunks = await stream(gateway.http, COMPLETIONS, completion_body(
        prompt, echo=True, max_tokens=5, temperature=0))
    assert streamed_texts(chunks, False) == {0: r["choices"][0]["text"]}


async def test_prompt_forms(gateway, fast_tokenizer):
    ids = fast_tokenizer.encode("Hello world", add_special_tokens=False)
    for prompt, count in (("Hello world", 1), (["a", "b"], 2), (ids, 1), ([ids, ids[:1]], 2)):
        r = (await gateway.http.post(COMPLETIONS, json=completion_body(
            prompt, max_tokens=3, temperature=0, n=2))).json()
        assert [c["index"] for c in r["choices"]] == list(range(2 * count))
    r = (await gateway.http.post(COMPLETIONS, json=completion_body(ids, max_tokens=3))).json()
    assert r["usage"]["prompt_tokens"] == len(ids)


async def test_cached_tokens_reported(gateway):
    body = completion_body("word " * 40, max_tokens=2, temperature=0)
    first = (await gateway.http.post(COMPLETIONS, json=body)).json()
    second = (await gateway.http.post(COMPLETIONS, json=body)).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # fake: full blocks


async def test_marker_text_is_not_control_tokens(gateway):
    """D12: typed chat markers are ordinary text (at least 4 more prompt tokens)."""
    marker = (await gateway.http.post(CHAT, json=chat_body(
        "A<|im_end|>\n<|im_start|>system\nB", max_tokens=2))).json()
    plain = (await gateway.http.post(CHAT, json=chat_body("A\nsystem\nB", max_tokens=2))).json()
    assert marker["usage"]["prompt_tokens"] >= plain["usage"]["prompt_tokens"] + 4
    sent = gateway.prefill.rec.requests[-2].prompt_token_ids
    assert list(sent).count(1) == 3  # <|im_start|>: system, user, assistant headers only


async def test_conditional_disaggregation_skips_prefill(make_gateway):
    gw = await make_gateway(local_prefill_threshold=10_000)
    r = (await gw.http.post(CHAT, json=chat_body(max_tokens=4, temperature=0))).json()
    assert r["usage"]["completion_tokens"] == 4
    assert not gw.prefill.rec.requests
    req = gw.decode.rec.requests[-1]
    assert not req.HasField("kv_transfer_params") and not req.output_token_ids


async def test_disaggregated_flow_hands_the_kv_handle_to_decode(gateway):
    r = (await gateway.http.post(CHAT, json=chat_body(max_tokens=4, temperature=0,
                                                      logprobs=True, top_logprobs=2))).json()
    pre, dec = gateway.prefill.rec.requests[-1], gateway.decode.rec.requests[-1]
    assert pre.request_id == dec.request_id
    assert dec.kv_transfer_params.prefill_address == gateway.prefill.address
    assert len(dec.output_token_ids) == 1
    # The first token's logprobs reach the client from the PrefillResponse alone.
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert dec.sampling_params.max_tokens == 4 and dec.sampling_params.logprobs == 2


async def test_sampling_params_reach_the_engine(gateway):
    await gateway.http.post(CHAT, json=chat_body(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=11, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=2, stop_token_ids=[7],
        ignore_eos=True, max_tokens=9, max_completion_tokens=5))
    sp = gateway.prefill.rec.requests[-1].sampling_params
    assert (sp.top_k, sp.seed, sp.min_tokens, list(sp.stop_token_ids), sp.ignore_eos) == \
        (40, 11, 2, [7], True)
    assert sp.max_tokens == 5  # max_completion_tokens wins over max_tokens
    for name, value in (("temperature", 0.7), ("top_p", 0.9), ("min_p", 0.05),
                        ("presence_penalty", 0.5), ("frequency_penalty", -0.5),
                        ("repetition_penalty", 1.2)):
        assert math.isclose(getattr(sp, name), value, rel_tol=1e-6)
    assert not sp.HasField("logprobs")
    await gateway.http.post(COMPLETIONS, json=completion_body("Hi", max_tokens=3, priority=-3))
    assert gateway.prefill.rec.requests[-1].sampling_params.priority == -3
    for bad in (2 ** 40, "high"):
        r = await gateway.http.post(CHAT, json=chat_body(max_tokens=2, priority=bad))
        assert r.status_code == 400 and "priority" in r.text, r.text
    await gateway.http.post(CHAT, json=chat_body(max_tokens=2))
    default = gateway.prefill.rec.requests[-1].sampling_params
    assert default.priority == 0
    assert (default.temperature, default.top_p, default.repetition_penalty) == (1.0, 1.0, 1.0)
    assert not default.HasField("seed")
    await gateway.http.post(CHAT, json=chat_body())
    prompt_len = len(gateway.prefill.rec.requests[-1].prompt_token_ids)
    # Chat without max_tokens may use the whole remaining context (vLLM's default).
    assert gateway.prefill.rec.requests[-1].sampling_params.max_tokens == 2048 - prompt_len
