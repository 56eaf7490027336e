"""Early rejection under a TTFT target (issue 29; Mooncake's early rejection): real engines
over gRPC behind the real gateway. A prompt the prefill instance predicts cannot keep the
target because of the load ahead of it is refused with a retryable 429 before any work; one
that cannot keep it even on an idle engine is served; both are counted in the instance's
metrics; the requests around them are served, and no block is left held."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.e2e.conftest import E2E_ENGINE, Urls
from tests.e2e.test_gateway_real import filler
from tests.services.gateway.conftest import SERVED_MODEL, running_gateway
from tests.services.helpers import start_cluster, wait_leak_free

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

SLO_TTFT_MS = 700.0
"""A 100-token prompt keeps it alone (0.15-0.3 s on 2 cores), a 2,000-token one cannot
(2.5+ s), nor a short one queued behind the long one's step."""


def unreachable(runtime, action: str) -> float:
    metrics = runtime.worker.metrics
    value = metrics.registry.get_sample_value(
        "pdserve_slo_ttft_unreachable_total",
        {"model_name": runtime.worker.model_name, "action": action})
    return value or 0.0


async def test_a_prompt_predicted_past_its_ttft_gets_429_and_the_others_are_served(
        model_path, tokenizer):
    cluster = await start_cluster(model_path, None, slo_ttft_ms=SLO_TTFT_MS,
                                  slo_early_reject=True, **E2E_ENGINE)
    try:
        urls = Urls((cluster.prefill.identity.address,), (cluster.decode.identity.address,))
        async with running_gateway(model_path, urls, rpc_timeout=30.0) as gw:  # type: ignore
            client = gw.client.with_options(timeout=120)
            # 1. two prompts of 100 tokens: served (no cost estimate yet: the engine's first
            #    prompt step has one-time costs and does not count); the second teaches the
            #    prefill its cost per token (~1.5 ms here)
            answers = []
            for seed in (1, 2):
                done = await client.completions.create(
                    model=SERVED_MODEL, prompt=filler(tokenizer, 100, seed=seed), max_tokens=4,
                    temperature=0)
                assert done.usage.completion_tokens == 4
                answers.append(done.choices[0].text)
            assert cluster.prefill.worker.engine_core.prefill_budget.recent_s_per_token
            # 2. a 2,000-token prompt cannot make 0.7 s even on an idle engine (>1 ms per
            #    token): it is served (a refusal would refuse every retry too), and counted.
            #    A 100-token prompt sent while it runs would keep the target alone but not
            #    behind it: refused at once, retryable (429 + Retry-After).
            body = {"model": SERVED_MODEL, "max_tokens": 2, "temperature": 0}
            long_prompt = filler(tokenizer, 2000, seed=3)
            short_prompt = filler(tokenizer, 100, seed=5)
            running = asyncio.ensure_future(gw.http.post(
                "/v1/completions", json={**body, "prompt": long_prompt}, timeout=120))
            await asyncio.sleep(0.5)  # the long prompt's step is under way (~3 s here)
            response = await gw.http.post("/v1/completions",
                                          json={**body, "prompt": short_prompt}, timeout=120)
            assert response.status_code == 429, response.text
            assert response.headers.get("retry-after"), response.headers
            error = response.json()["error"]
            assert "cannot meet the TTFT target" in error["message"], error
            assert "--slo-early-reject" in error["message"], error
            served = await running
            assert served.status_code == 200, served.text
            assert served.json()["usage"]["completion_tokens"] == 2
            # the same through the openai client, on chat
            running = asyncio.ensure_future(client.completions.create(
                prompt=filler(tokenizer, 2000, seed=6), **body))
            await asyncio.sleep(0.5)
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(
                    model=SERVED_MODEL, max_tokens=2,
                    messages=[{"role": "user", "content": filler(tokenizer, 80, seed=7)}])
            assert (await running).usage.completion_tokens == 2
            # 3. a shorter prompt right after is served, and the first again gets its answer
            short = await client.completions.create(
                model=SERVED_MODEL, prompt=filler(tokenizer, 40, seed=4), max_tokens=4)
            assert short.usage.completion_tokens == 4
            again = await client.completions.create(
                model=SERVED_MODEL, prompt=filler(tokenizer, 100, seed=1), max_tokens=4,
                temperature=0)
            assert again.choices[0].text == answers[0]
            # counted on the prefill instance, as refused (the decode saw none of them)
            deadline = time.monotonic() + 15
            while unreachable(cluster.prefill, "rejected") < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert unreachable(cluster.prefill, "rejected") == 2
            assert unreachable(cluster.prefill, "served") == 2  # the two long prompts
            assert unreachable(cluster.decode, "rejected") == 0
            prefill, decode = await wait_leak_free(cluster)
            for state in (prefill, decode):
                assert state.num_used_blocks == 0 and state.num_pinned_blocks == 0, state
                assert state.num_running == 0 and state.num_waiting == 0, state
    finally:
        await cluster.close()
