"""End-to-end echo + logprobs on /v1/completions: the real gateway (official `openai` client)
in front of real prefill and decode services. The prompt's logprobs come from the prefill
instance (PrefillResponse.prompt_logprobs) or, under conditional disaggregation, from the
decode instance's local prefill (first TokenChunk); both must agree."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.e2e.conftest import E2E_ENGINE, Urls
from tests.services.gateway.conftest import SERVED_MODEL, running_gateway
from tests.services.helpers import Cluster, start_cluster

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(model_path) -> AsyncIterator[Cluster]:
    c = await start_cluster(model_path, None, **E2E_ENGINE)
    yield c
    await c.close()


async def echo_logprobs(cluster: Cluster, model_path: str, threshold: int, stream: bool):
    urls = Urls((cluster.prefill.identity.address,), (cluster.decode.identity.address,))
    async with running_gateway(model_path, urls, rpc_timeout=10.0,  # type: ignore[arg-type]
                               local_prefill_threshold=threshold) as gw:
        client = gw.client.with_options(timeout=120)
        kwargs = dict(model=SERVED_MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                      temperature=0)
        if not stream:
            resp = await client.completions.create(**kwargs)
            return resp.choices[0].text, resp.choices[0].logprobs.model_dump(), resp.usage
        chunks = [c async for c in await client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True})]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        lps = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in chunks:
            for key in lps:
                lps[key] += (c.choices[0].logprobs.model_dump()[key]
                             if c.choices and c.choices[0].logprobs else [])
        return text, lps, chunks[-1].usage


async def test_echo_logprobs_real(cluster, model_path):
    # Through the prefill instance (threshold 0), streamed and not.
    text, lps, usage = await echo_logprobs(cluster, model_path, 0, stream=False)
    n = usage.prompt_tokens
    assert usage.completion_tokens == 3
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == n + 3
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lps["token_logprobs"][1:])
    assert all(2 <= len(top) <= 3 for top in lps["top_logprobs"][1:])
    assert text.startswith(PROMPT) and "".join(lps["tokens"][:n]) == PROMPT
    # Greedy: the first generated token is the most likely one after the prompt.
    assert lps["token_logprobs"][n] == pytest.approx(max(lps["top_logprobs"][n].values()))
    streamed = await echo_logprobs(cluster, model_path, 0, stream=True)
    assert streamed[0] == text and streamed[1]["tokens"] == lps["tokens"]
    assert streamed[1]["token_logprobs"][1:] == pytest.approx(lps["token_logprobs"][1:],
                                                              abs=1e-5)

    # The decode instance prefilling locally gives the same answer.
    local_text, local_lps, local_usage = await echo_logprobs(cluster, model_path, 10**6,
                                                             stream=False)
    assert local_text == text and local_lps["tokens"] == lps["tokens"]
    assert local_lps["token_logprobs"][0] is None
    assert local_lps["token_logprobs"][1:] == pytest.approx(lps["token_logprobs"][1:],
                                                            abs=1e-4)
    assert local_usage.prompt_tokens_details.cached_tokens == 0  # computed in full
