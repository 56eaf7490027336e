"""echo + logprobs on /v1/completions (vLLM's format): the prompt's tokens first (the first
with a null logprob and null top_logprobs), then the generated ones; streamed and not, through
a prefill instance and through a local prefill, and with max_tokens 0 (prompt only)."""

from __future__ import annotations

import pytest

from tests.services.gateway.conftest import SERVED_MODEL
from tests.services.gateway.helpers import COMPLETIONS, completion_body, stream

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "Your answer: Yes, and no"


def joined_logprobs(chunks: list) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for ch in c["choices"]:
            for key in out:
                out[key] += (ch["logprobs"] or {}).get(key, [])
    return out


def expected_prompt_part(fast_tokenizer, fake_model, k: int) -> tuple[list[int], list[float]]:
    ids = fast_tokenizer.encode(PROMPT, add_special_tokens=False)
    values = [fake_model.logprobs(t, 1000 + i, k).logprob for i, t in enumerate(ids[1:])]
    return ids, values


def assert_echo_logprobs(lps: dict, text: str, ids: list[int], prompt_values: list[float],
                         num_generated: int, k: int) -> None:
    n = len(ids)
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["top_logprobs"]) \
        == len(lps["text_offset"]) == n + num_generated
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert lps["token_logprobs"][1:n] == pytest.approx(prompt_values, abs=1e-6)
    assert all(isinstance(v, float) and v <= 0 for v in lps["token_logprobs"][1:])
    assert all(k <= len(top) <= k + 1 for top in lps["top_logprobs"][1:])
    # Offsets count from the start of the echoed prompt, token after token.
    assert lps["text_offset"][0] == 0
    for i in range(1, len(lps["tokens"])):
        assert lps["text_offset"][i] == lps["text_offset"][i - 1] + len(lps["tokens"][i - 1])
    assert "".join(lps["tokens"][:n]) == PROMPT
    assert text.startswith(PROMPT)


@pytest.mark.parametrize("local", [False, True])
async def test_echo_with_logprobs(make_gateway, cluster, fast_tokenizer, fake_model, local):
    # local: every prompt is under the threshold, the decode instance prefills it itself.
    gw = await make_gateway(local_prefill_threshold=10**6 if local else 0)
    ids, values = expected_prompt_part(fast_tokenizer, fake_model, 2)
    resp = await gw.client.completions.create(model=SERVED_MODEL, prompt=PROMPT, echo=True,
                                              logprobs=2, max_tokens=3, temperature=0)
    choice = resp.choices[0]
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 3
    lps = choice.logprobs.model_dump()
    assert_echo_logprobs(lps, choice.text, ids, values, 3, 2)
    assert choice.text == PROMPT + "".join(lps["tokens"][len(ids):])
    # The engine was asked for the prompt's logprobs (top 2), on the instance computing it.
    first = (cluster.decodes if local else cluster.prefills)[0].rec.requests[0]
    assert first.sampling_params.prompt_logprobs == 2
    assert not cluster.prefills[0].rec.requests if local else True

    chunks = await stream(gw.http, COMPLETIONS, completion_body(
        PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0))
    streamed = joined_logprobs(chunks)
    assert streamed == lps
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice.text


async def test_echo_only_with_logprobs(gateway, fast_tokenizer, fake_model):
    """max_tokens 0: the prompt and its logprobs, nothing generated or counted."""
    ids, values = expected_prompt_part(fast_tokenizer, fake_model, 1)
    body = completion_body(PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0)
    r = await gateway.http.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 0
    assert data["usage"]["prompt_tokens"] == len(ids)
    assert_echo_logprobs(choice["logprobs"], choice["text"], ids, values, 0, 1)
    chunks = await stream(gateway.http, COMPLETIONS, body)
    assert joined_logprobs(chunks) == choice["logprobs"]


async def test_logprobs_without_echo_and_echo_without_logprobs(gateway, cluster):
    r = (await gateway.http.post(COMPLETIONS, json=completion_body(
        PROMPT, logprobs=2, max_tokens=3, temperature=0))).json()
    assert len(r["choices"][0]["logprobs"]["tokens"]) == 3
    assert None not in r["choices"][0]["logprobs"]["token_logprobs"]
    r = (await gateway.http.post(COMPLETIONS, json=completion_body(
        PROMPT, echo=True, max_tokens=3, temperature=0))).json()
    assert r["choices"][0]["logprobs"] is None and r["choices"][0]["text"].startswith(PROMPT)
    # Neither asked the engine for prompt logprobs (they cost a full-prompt computation).
    assert all(not req.sampling_params.HasField("prompt_logprobs")
               for req in cluster.prefills[0].rec.requests)
