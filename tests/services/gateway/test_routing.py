"""Cache-aware routing through the real Redis PrefixIndex (a throwaway redis-server) to two
prefill and two decode fake instances: the request goes to the ones holding its prefix."""

from __future__ import annotations

import pytest

from pdserve.services.common.prefix_index import InstanceInfo, PrefixIndex
from pdserve.shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens
from tests.services.gateway.conftest import SERVED_MODEL
from tests.services.gateway.fake_engine import MODEL, start_fake_cluster
from tests.services.gateway.helpers import COMPLETIONS, completion_body

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = list(range(1000, 1000 + 80))  # 5 full blocks


async def test_repeated_prefix_goes_to_the_instances_holding_it(make_gateway, fake_model,
                                                                 redis_server):
    fakes = await start_fake_cluster(fake_model, num_prefill=2, num_decode=2)
    index = PrefixIndex(redis_server.url, SERVED_MODEL)
    try:
        for s in fakes.prefills + fakes.decodes:
            role = "prefill" if s in fakes.prefills else "decode"
            await index.register(InstanceInfo(s.instance_id, role, s.address, SERVED_MODEL))
        # The engine's model name (GetState) is the hash key, as the instances compute it.
        hashes = hash_request_tokens(PROMPT, fake_model.block_size, block_extra_keys(MODEL, None))
        assert await index.publish("prefill-1", hashes, [])
        assert await index.publish("decode-1", hashes[:4], [])
        assert await index.publish("decode-0", hashes[:2], [])
        gw = await make_gateway(fakes, redis_url=redis_server.url, prefill_urls=(),
                                decode_urls=())
        assert (await gw.http.get("/health")).status_code == 200
        for _ in range(3):
            # NOTE: greedy and ignore_eos: a sampled first token may be EOS, and a request
            # that ends at the prefill never reaches a decode instance.
            r = await gw.http.post(COMPLETIONS, json=completion_body(
                PROMPT, max_tokens=3, temperature=0, ignore_eos=True))
            assert r.status_code == 200, r.text
        assert len(fakes.prefills[1].rec.requests) == 3 and not fakes.prefills[0].rec.requests
        assert len(fakes.decodes[1].rec.requests) == 3 and not fakes.decodes[0].rec.requests
        # Another prompt: no affinity anywhere, load decides (both idle: the first listed).
        first = [(await index.live_instances(role))[0].address for role in ("prefill", "decode")]
        before = {s.address: len(s.rec.requests) for s in fakes.prefills + fakes.decodes}
        r = await gw.http.post(COMPLETIONS, json=completion_body(
            [7] * 40, max_tokens=2, temperature=0, ignore_eos=True))
        assert r.status_code == 200, r.text
        served = [s.address for s in fakes.prefills + fakes.decodes
                  if len(s.rec.requests) > before[s.address]]
        assert served == first
    finally:
        await index.close()
        await fakes.stop()
