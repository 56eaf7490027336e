"""Early rejection under a TTFT target (issue 29; Mooncake's early rejection): real prefill
and decode processes over gRPC behind the real gateway. A prompt the prefill instance
predicts cannot keep the target because of the load ahead of it is refused with a retryable
429 before any work; one that cannot keep it even on an idle engine is served; both are
counted in the instance's metrics; the requests around them are served, and no block is
left held.

(The engines run as processes, not in the test process: an in-process cluster of its own
would stay in pytest's memory for the rest of the suite.)
"""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import httpx
import openai
import pytest

from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from tests.e2e.conftest import Urls
from tests.e2e.test_gateway_real import filler
from tests.procs import ServiceGroup
from tests.services.gateway.conftest import SERVED_MODEL, running_gateway

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

SLO_TTFT_MS = 700.0
"""A 100-token prompt keeps it alone (0.15-0.5 s on one thread), a 2,000-token one cannot
(2.5+ s), nor a short one queued behind the long one's step."""


async def unreachable(client: httpx.AsyncClient, metrics_port: int, action: str) -> float:
    text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    m = re.search(r'^pdserve_slo_ttft_unreachable_total\{[^}]*action="' + action
                  + r'"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def engine_state(address: str, role: str) -> pb.EngineState:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = (engine_pb2_grpc.PrefillServiceStub if role == "prefill"
                else engine_pb2_grpc.DecodeServiceStub)(channel)
        return await stub.GetState(pb.GetStateRequest(check_invariants=True), timeout=30)


async def test_a_prompt_predicted_past_its_ttft_gets_429_and_the_others_are_served(
        model_path, tokenizer, tmp_path):
    flags = ("--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-early-reject")
    with ServiceGroup(tmp_path) as group:
        prefill = group.start("prefill", model_path, *flags)
        decode = group.start("decode", model_path, *flags)
        await asyncio.to_thread(group.wait_serving)
        urls = Urls((prefill.address,), (decode.address,))
        async with running_gateway(model_path, urls, rpc_timeout=60.0) as gw:  # type: ignore
            client = gw.client.with_options(timeout=120)
            # 1. two prompts of 100 tokens: served (no cost estimate yet: the engine's first
            #    prompt step has one-time costs and does not count); the second teaches the
            #    prefill its cost per token
            answers = []
            for seed in (1, 2):
                done = await client.completions.create(
                    model=SERVED_MODEL, prompt=filler(tokenizer, 100, seed=seed), max_tokens=4,
                    temperature=0)
                assert done.usage.completion_tokens == 4
                answers.append(done.choices[0].text)
            # 2. a 2,000-token prompt cannot make 0.7 s even on an idle engine (>1 ms per
            #    token): it is served (a refusal would refuse every retry too), and counted.
            #    A 100-token prompt sent while it runs would keep the target alone but not
            #    behind it: refused at once, retryable (429 + Retry-After).
            body = {"model": SERVED_MODEL, "max_tokens": 2, "temperature": 0}
            running = asyncio.ensure_future(gw.http.post(
                "/v1/completions", json={**body, "prompt": filler(tokenizer, 2000, seed=3)},
                timeout=120))
            await asyncio.sleep(0.5)  # the long prompt's step is under way (seconds)
            response = await gw.http.post(
                "/v1/completions", json={**body, "prompt": filler(tokenizer, 100, seed=5)},
                timeout=120)
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
            # counted on the prefill instance: two refused, two served anyway (the long
            # prompts); the decode saw none of them
            async with httpx.AsyncClient(timeout=10) as http:
                deadline = time.monotonic() + 15
                while await unreachable(http, prefill.metrics_port, "rejected") < 2 and \
                        time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert await unreachable(http, prefill.metrics_port, "rejected") == 2
                assert await unreachable(http, prefill.metrics_port, "served") == 2
                assert await unreachable(http, decode.metrics_port, "rejected") == 0
            deadline = time.monotonic() + 30
            while True:
                states = [await engine_state(prefill.address, "prefill"),
                          await engine_state(decode.address, "decode")]
                idle = all(s.num_used_blocks == 0 and s.num_pinned_blocks == 0
                           and s.num_running == 0 and s.num_waiting == 0 for s in states)
                if idle or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert idle, states
