"""End-to-end: vLLM's request fields applied through the real gateway over the split (real
prefill and decode services, SmolLM2): bad_words, allowed_token_ids, truncate_prompt_tokens,
prompt_logprobs, beam search (issue 36). Greedy throughout, so each field's effect is a
fixed, checkable answer; prompt logprobs and beams are checked against transformers' fp32
model."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch

from tests.e2e.conftest import E2E_ENGINE, Urls
from tests.services.gateway.conftest import SERVED_MODEL, RunningGateway, running_gateway
from tests.services.helpers import Cluster, start_cluster

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

FRANCE = "The capital of France is"
ATOL = 1e-4


def hf_prompt_logprobs(model_path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers, fp32: per prompt, [len - 1, vocab] log-softmax after each prefix."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
                for ids in prompts]


def assert_prompt_logprobs(got: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape: None, then {id: {logprob, rank, decoded_token}}, the prompt token first
    and the k most likely after it; values as transformers' within ATOL."""
    assert len(got) == len(ids) and got[0] is None
    for p, entry in enumerate(got[1:]):
        token = ids[p + 1]
        keys = [int(t) for t in entry]
        assert keys[0] == token
        actual = entry[str(token)]
        assert abs(actual["logprob"] - ref[p, token].item()) <= ATOL
        assert abs(actual["rank"] - int((ref[p] >= ref[p, token]).sum())) <= 1  # near-ties
        values, top = ref[p].topk(k)
        clear = k < 2 or bool((values[:-1] - values[1:]).min() > 10 * ATOL)
        assert len(keys) in (k, k + 1) and (not clear or set(top.tolist()) <= set(keys))
        for t in keys:
            assert abs(entry[str(t)]["logprob"] - ref[p, t].item()) <= ATOL
            assert isinstance(entry[str(t)]["decoded_token"], str)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(model_path) -> AsyncIterator[Cluster]:
    c = await start_cluster(model_path, None, **E2E_ENGINE)
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(model_path, cluster) -> AsyncIterator[RunningGateway]:
    urls = Urls((cluster.prefill.identity.address,), (cluster.decode.identity.address,))
    async with running_gateway(model_path, urls, rpc_timeout=10.0) as gw:  # type: ignore[arg-type]
        yield gw


async def complete(gw: RunningGateway, prompt, max_tokens: int = 6, **extra) -> dict:
    resp = await gw.http.post("/v1/completions", timeout=120, json=dict(
        model=SERVED_MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra))
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_bad_words_ban_the_greedy_answer(gateway):
    plain = (await complete(gateway, FRANCE))["choices"][0]["text"]
    assert plain.startswith(" Paris")
    for endpoint_extra in ({}, {"stream": False, "logprobs": 1}):
        banned = (await complete(gateway, FRANCE, max_tokens=12, bad_words=["Paris"],
                                 **endpoint_extra))["choices"][0]["text"]
        assert "Paris" not in banned and banned.strip()
    chat = await gateway.http.post("/v1/chat/completions", timeout=120, json=dict(
        model=SERVED_MODEL, max_tokens=16, temperature=0, bad_words=[" Paris"],
        messages=[{"role": "user", "content": "What is the capital of France?"}]))
    assert chat.status_code == 200, chat.text
    assert "Paris" not in chat.json()["choices"][0]["message"]["content"]


async def test_allowed_token_ids_only_those_are_generated(gateway, tokenizer):
    allowed = tokenizer.encode(" London.", add_special_tokens=False)
    assert len(allowed) == 2
    body = await complete(gateway, FRANCE, max_tokens=5, logprobs=0, allowed_token_ids=allowed)
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 5  # EOS is not allowed: to max_tokens
    texts = {tokenizer.decode([t]) for t in allowed}
    assert set(tokens) <= texts, tokens
    assert body["choices"][0]["text"] == "".join(tokens)
    # A special token forced by allowed_token_ids: skip_special_tokens decides the text.
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert special != tokenizer.eos_token_id
    for skip, text in ((False, "<|im_start|>" * 3), (True, "")):
        body = await complete(gateway, FRANCE, max_tokens=3, allowed_token_ids=[special],
                              skip_special_tokens=skip, return_token_ids=True)
        assert body["choices"][0]["token_ids"] == [special] * 3
        assert body["choices"][0]["text"] == text


async def test_truncate_prompt_tokens_keeps_the_last_n(gateway, tokenizer):
    long_ids = tokenizer.encode("one two three " * 1000, add_special_tokens=False)[:3000]
    long_ids += tokenizer.encode(" " + FRANCE, add_special_tokens=False)
    too_long = await gateway.http.post("/v1/completions", json=dict(
        model=SERVED_MODEL, prompt=long_ids, max_tokens=4, temperature=0))
    assert too_long.status_code == 400
    truncated = await complete(gateway, long_ids, max_tokens=4, truncate_prompt_tokens=100)
    assert truncated["usage"]["prompt_tokens"] == 100
    tail = await complete(gateway, long_ids[-100:], max_tokens=4)
    assert truncated["choices"][0]["text"] == tail["choices"][0]["text"]
    chat = await gateway.http.post("/v1/chat/completions", timeout=120, json=dict(
        model=SERVED_MODEL, max_tokens=2, temperature=0, truncate_prompt_tokens=7,
        messages=[{"role": "user", "content": "one two three " * 700}]))
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == 7


@pytest.mark.parametrize("field,value", [
    ("allowed_token_ids", [-1]), ("allowed_token_ids", []), ("bad_words", [""]),
    ("truncate_prompt_tokens", 4096), ("truncate_prompt_tokens", 0), ("prompt_logprobs", -1),
    ("prompt_logprobs", 21)])
async def test_invalid_values_are_refused_naming_the_field(gateway, field, value):
    resp = await gateway.http.post("/v1/completions", json={
        "model": SERVED_MODEL, "prompt": FRANCE, "max_tokens": 2, field: value})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field


@pytest.mark.fp32_only  # the reference is transformers' fp32 model
async def test_prompt_logprobs_equal_transformers_fp32(model_path, tokenizer, gateway):
    ids = tokenizer.encode(FRANCE + " Paris. The capital of Germany is", add_special_tokens=False)
    tokenized = await gateway.http.post("/tokenize", json=dict(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "Name a color."}]))
    chat_ids = tokenized.json()["tokens"]
    ref, chat_ref = hf_prompt_logprobs(model_path, [ids, chat_ids])
    body = await complete(gateway, ids, max_tokens=2, prompt_logprobs=3, n=2, seed=1,
                          echo=True, logprobs=1)
    for choice in body["choices"]:
        assert_prompt_logprobs(choice["prompt_logprobs"], ids, ref, 3)
        # echo keeps its own 1 alternative (plus the token itself) beside prompt_logprobs=3
        assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    chat = await gateway.http.post("/v1/chat/completions", timeout=120, json=dict(
        model=SERVED_MODEL, max_tokens=2, temperature=0, prompt_logprobs=0,
        messages=[{"role": "user", "content": "Name a color."}]))
    assert chat.status_code == 200, chat.text
    assert_prompt_logprobs(chat.json()["prompt_logprobs"], chat_ids, chat_ref, 0)
    assert "prompt_logprobs" not in (await complete(gateway, ids, max_tokens=1))["choices"][0]
    echoed = await complete(gateway, ids, max_tokens=1, echo=True, logprobs=2)
    assert_prompt_logprobs(echoed["choices"][0]["prompt_logprobs"], ids, ref, 2)  # as vLLM
    streamed = await gateway.http.post("/v1/completions", json=dict(
        model=SERVED_MODEL, prompt=ids, max_tokens=1, prompt_logprobs=1, stream=True))
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.fp32_only  # the reference is transformers' fp32 model
async def test_beam_search_best_beam_equals_transformers(model_path, tokenizer, gateway):
    from transformers import AutoModelForCausalLM

    ids = tokenizer.encode("The three primary colors are", add_special_tokens=False)
    messages = [{"role": "user", "content": "Name a fruit."}]
    chat_ids = (await gateway.http.post("/tokenize", json=dict(
        model=SERVED_MODEL, messages=messages))).json()["tokens"]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        refs = [model.generate(torch.tensor([p]), num_beams=3, do_sample=False,
                               max_new_tokens=8, num_return_sequences=3, length_penalty=1.0,
                               early_stopping=False) for p in (ids, chat_ids)]
    del model
    body = await complete(gateway, ids, max_tokens=8, n=3, use_beam_search=True)
    chat = (await gateway.http.post("/v1/chat/completions", timeout=120, json=dict(
        model=SERVED_MODEL, messages=messages, max_tokens=8, n=3,
        use_beam_search=True))).json()
    for prompt, ref, resp, text_of in (
            (ids, refs[0], body, lambda c: c["text"]),
            (chat_ids, refs[1], chat, lambda c: c["message"]["content"])):
        texts = [text_of(c) for c in resp["choices"]]
        assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
        # every beam, best first, as transformers' (no EOS among 8-token candidates here)
        assert texts == [tokenizer.decode(r[len(prompt):], skip_special_tokens=True)
                         for r in ref]
        assert len(set(texts)) == 3
        assert resp["usage"]["completion_tokens"] == 24
        assert all(c["finish_reason"] == "length" for c in resp["choices"])
    streamed = await gateway.http.post("/v1/completions", json=dict(
        model=SERVED_MODEL, prompt=ids, max_tokens=2, n=2, use_beam_search=True, stream=True))
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    with_stop = await gateway.http.post("/v1/completions", json=dict(
        model=SERVED_MODEL, prompt=ids, max_tokens=2, n=2, use_beam_search=True, stop=["x"]))
    assert with_stop.status_code == 400 and with_stop.json()["error"]["param"] == "stop"
