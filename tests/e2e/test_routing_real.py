"""Cache-aware routing with REAL instances (issue 4's acceptance): two prefill and two decode
services (real engines, in-process gRPC) registered in a real Redis, and the real gateway
placing requests from that registry. A request repeating a long prefix goes to the
instances that hold it, asserted on the instances' own Prometheus metrics (scraped over
their metrics HTTP ports): prefix-cache hits, prompt tokens, KV blocks received.

Two long prefixes live on two different prefill/decode pairs (one placed by the gateway,
the other warmed directly over gRPC on the remaining pair), so that no cache-blind policy
(list order, least loaded) can send the repeats of both to their holders.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.proto import engine_pb2_grpc
from tests.e2e.conftest import E2E_ENGINE, Urls
from tests.services.gateway.conftest import SERVED_MODEL, running_gateway
from tests.services.helpers import (
    channel,
    engine_args,
    greedy,
    run_split,
    service_config,
    start_runtime,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

BLOCK = 16
PREFIX_LEN = 500
"""31 full blocks (496 tokens) + 4: every repeat hits exactly 496 cached tokens."""
PREFIX_HIT = PREFIX_LEN // BLOCK * BLOCK
THRESHOLD = 8
"""--local-prefill-threshold: repeats with a >= 4-token suffix (uncached 4 + suffix >= 8)
still go through a prefill instance; a 2-token suffix (uncached 6) is prefilled locally."""
NUM_ROUNDS = 3
WATCHED = ("pdserve_prefix_cache_hits_total", "pdserve_prompt_tokens_total",
           "pdserve_kv_transfer_blocks_received_total", "pdserve_request_success_total")
HITS, PROMPT, RECEIVED, REQUESTS = WATCHED
WORDS = ("river mountain lantern violet copper harbor meadow silent orange falcon thunder "
         "garden pencil winter marble candle shadow forest bridge ocean velvet engine "
         "planet whisper ladder compass saddle mirror basket cobalt tunnel village").split()


def token_ids(tokenizer, n: int, seed: int) -> list[int]:
    """Exactly `n` real token ids of random words (distinct seeds share no leading block)."""
    rng = random.Random(seed)
    ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(n)),
                           add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


@contextlib.asynccontextmanager
async def four_instances(model_path: str, redis_url: str):
    """Two prefill and two decode runtimes registered in Redis; all stopped on the way out."""
    runtimes = []
    args = engine_args(model_path, served_model_name=SERVED_MODEL, **E2E_ENGINE)
    try:
        for role in ("prefill", "prefill", "decode", "decode"):
            runtimes.append(await start_runtime(service_config(role, redis_url), args))
        await asyncio.gather(*(r.wait_ready(300) for r in runtimes))
        for r in runtimes:  # registered and published before the gateway looks
            await r.monitor.flush()
        yield runtimes[:2], runtimes[2:]
    finally:
        await asyncio.wait_for(asyncio.gather(*(r.stop(0.5) for r in runtimes),
                                              return_exceptions=True), 60)


async def scrape(http: httpx.AsyncClient, runtimes) -> list[dict[str, float]]:
    """The WATCHED counters of each runtime from its /metrics endpoint (label sets summed)."""
    out = []
    for runtime in runtimes:
        await runtime.monitor.flush()  # the engine-polled counters are current
        r = await http.get(f"http://127.0.0.1:{runtime.metrics_port}/metrics")
        assert r.status_code == 200
        values = dict.fromkeys(WATCHED, 0.0)
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.name in values:
                    values[sample.name] += sample.value
        out.append(values)
    return out


def delta(after, before, name: str) -> list[int]:
    return [int(a[name] - b[name]) for a, b in zip(after, before, strict=True)]


async def complete(client, prompt: list[int]):
    return await client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=4,
                                           temperature=0)


def cached_tokens(resp) -> int:
    details = resp.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


async def test_repeated_prefix_goes_to_the_instances_holding_it(model_path, tokenizer,
                                                                 redis_server):
    if redis_server is None:
        pytest.skip("redis-server is not installed")
    p1 = token_ids(tokenizer, PREFIX_LEN, seed=1)
    p2 = token_ids(tokenizer, PREFIX_LEN, seed=2)
    suffixes = [token_ids(tokenizer, 8 + 4 * i, seed=100 + i) for i in range(2 * NUM_ROUNDS)]
    unrelated = [token_ids(tokenizer, 300, seed=200 + i) for i in range(NUM_ROUNDS)]
    async with (four_instances(model_path, redis_server.url) as (prefills, decodes),
                httpx.AsyncClient(timeout=30) as http,
                running_gateway(model_path, Urls((), ()), redis_url=redis_server.url,  # type: ignore[arg-type]
                                local_prefill_threshold=THRESHOLD, rpc_timeout=30.0) as gw):
        client = gw.client.with_options(timeout=120)
        assert (await gw.http.get("/health")).status_code == 200
        everyone = prefills + decodes

        # 1. The first long prompt: prefilled by one prefill instance, sent to one decode.
        s0 = await scrape(http, everyone)
        first = await complete(client, p1)
        s1 = await scrape(http, everyone)
        assert first.usage.prompt_tokens == PREFIX_LEN and cached_tokens(first) == 0
        prompt_d = delta(s1, s0, PROMPT)
        assert sorted(prompt_d[:2]) == [0, PREFIX_LEN], prompt_d
        received = delta(s1, s0, RECEIVED)[2:]
        assert sorted(received) == [0, -(-PREFIX_LEN // BLOCK)], received
        a_p, a_d = prompt_d.index(PREFIX_LEN), received.index(max(received))
        b_p, b_d = 1 - a_p, 1 - a_d
        assert delta(s1, s0, HITS) == [0, 0, 0, 0]

        # 2. The other long prefix, warmed directly on the other pair (prefill B -> decode B).
        channels = [channel(prefills[b_p].identity.address),
                    channel(decodes[b_d].identity.address)]
        try:
            pair = SimpleNamespace(
                prefill_stub=engine_pb2_grpc.PrefillServiceStub(channels[0]),
                decode_stub=engine_pb2_grpc.DecodeServiceStub(channels[1]))
            warmed = await run_split(pair, "warm-p2", p2, greedy(4))  # type: ignore[arg-type]
            assert len(warmed.token_ids) == 4
        finally:
            for ch in channels:
                await ch.close()

        # 3. Repeats of both prefixes, interleaved with unrelated long prompts, concurrently.
        s2 = await scrape(http, everyone)
        # The gateway places from its copy of the index, refreshed each second in the
        # background (issue 37): take now the refresh that would come within a second.
        await gw.app.state.gateway.engine.placer.registry.refresh()
        served = []
        for i in range(NUM_ROUNDS):
            r1, r2, u = await asyncio.gather(
                complete(client, p1 + suffixes[2 * i]), complete(client, p2 + suffixes[2 * i + 1]),
                complete(client, unrelated[i]))
            assert cached_tokens(r1) == cached_tokens(r2) == PREFIX_HIT, (r1.usage, r2.usage)
            assert cached_tokens(u) == 0
            served.append((r1, r2, u))
        s3 = await scrape(http, everyone)
        hits = delta(s3, s2, HITS)
        expected = [0, 0, 0, 0]
        for holders in ((a_p, 2 + a_d), (b_p, 2 + b_d)):
            for k in holders:
                expected[k] += NUM_ROUNDS * PREFIX_HIT
        # Only the holders' caches were hit, each by exactly its prefix's repeats.
        assert hits == expected, (hits, expected)
        requests = delta(s3, s2, REQUESTS)
        assert sum(requests[:2]) == sum(requests[2:]) == 3 * NUM_ROUNDS, requests
        total_prompt = sum(r.usage.prompt_tokens for trio in served for r in trio)
        assert sum(delta(s3, s2, PROMPT)[:2]) == total_prompt

        # 4. A repeat whose uncached part is under the threshold: straight to decode A.
        s4 = await scrape(http, everyone)
        local = await complete(client, p1 + suffixes[0][:2])
        s5 = await scrape(http, everyone)
        assert cached_tokens(local) == PREFIX_HIT
        expected = [0, 0, 0, 0]
        expected[2 + a_d] = PREFIX_HIT
        assert delta(s5, s4, HITS) == expected
        expected[2 + a_d] = PREFIX_LEN + 2
        assert delta(s5, s4, PROMPT) == expected  # prefilled on decode A, nowhere else

        # Nothing leaked: every pool is back to no used or pinned block.
        for runtime in everyone:
            for _ in range(200):
                state = await runtime.worker.get_state(check_invariants=True)
                if state.num_used_blocks == state.num_pinned_blocks == 0:
                    break
                await asyncio.sleep(0.05)
            assert state.invariants_ok, state.invariants_error
            assert state.num_used_blocks == state.num_pinned_blocks == 0, state
