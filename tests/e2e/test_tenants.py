"""End-to-end tenant isolation of the prefix cache (issue 6) and the leak audit: the real
gateway with two API keys and a Redis prefix index in front of real prefill and decode
services.

Tenant B sending tenant A's long prompt gets no cached tokens (nor with A's salt in its
body), while A's repeat does; the salts separate the engines' block hashes, the Redis
index and the gateway's routing lookups; GET /debug/kv-audit reports both pools.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from pdserve.services.gateway.tenancy import tenant_cache_salt
from pdserve.shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens
from tests.e2e.conftest import Urls
from tests.services.gateway.conftest import RunningGateway, running_gateway
from tests.services.helpers import (
    get_states,
    index_matches,
    wait_leak_free,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

KEY_A, KEY_B = "sk-tenant-a-e2e", "sk-tenant-b-e2e"
ADMIN = "sk-operator-e2e"
SALT_A, SALT_B = tenant_cache_salt(KEY_A), tenant_cache_salt(KEY_B)
PROMPT_TOKENS = 420
WORDS = "river mountain lantern violet copper harbor meadow silent orange falcon".split()
# (key, body cache_salt, the salt the engines must see), in the order they are sent.
SENDS = [(KEY_A, None, SALT_A), (KEY_B, None, SALT_B), (KEY_A, None, SALT_A),
         (KEY_B, SALT_A, f"{SALT_B}:{SALT_A}"), (KEY_B, None, SALT_B),
         (KEY_A, "team-1", f"{SALT_A}:team-1")]
MEASURED: dict = {}
"""What the tests saw, printed for docs/reliability.md (`pytest -s`)."""


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    rng = random.Random(606)
    text = " ".join(rng.choice(WORDS) for _ in range(PROMPT_TOKENS + 50))
    ids = tokenizer.encode(text, add_special_tokens=False)[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return ids


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tenant_gateway(model_path, redis_cluster, redis_server
                         ) -> AsyncIterator[tuple[RunningGateway, list[tuple[bytes, ...]]]]:
    """The gateway, and the block hashes of every routing lookup it makes in Redis."""
    urls = Urls((redis_cluster.prefill.identity.address,),
                (redis_cluster.decode.identity.address,))
    async with running_gateway(
            model_path, urls,  # type: ignore[arg-type]
            api_key=f"{KEY_A},{KEY_B}", admin_api_key=ADMIN, redis_url=redis_server.url,
            served_model_name=redis_cluster.prefill.worker.model_name,
            rpc_timeout=10.0) as gw:
        registry = gw.app.state.gateway.engine.placer.registry
        lookups: list[tuple[bytes, ...]] = []
        longest_prefix = registry.longest_prefix

        async def recording_longest_prefix(block_hashes):
            lookups.append(tuple(block_hashes))
            return await longest_prefix(block_hashes)

        registry.longest_prefix = recording_longest_prefix
        yield gw, lookups


async def _complete(gw: RunningGateway, ids: list[int], key: str, body_salt: str | None
                    ) -> dict:
    body = {"model": gw.config.served_model_name, "prompt": ids, "max_tokens": 2,
            "temperature": 0}
    if body_salt is not None:
        body["cache_salt"] = body_salt
    r = await gw.http.post("/v1/completions", json=body, headers=_bearer(key), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


async def test_tenants_do_not_share_cached_prefixes(tenant_gateway, prompt_ids):
    gw, _ = tenant_gateway
    replies = [await _complete(gw, prompt_ids, key, body_salt) for key, body_salt, _ in SENDS]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    MEASURED["cached_tokens"] = cached
    print(f"\ntenants: prompt {PROMPT_TOKENS} tokens; cached_tokens per send "
          f"(A, B, A, B+A's salt, B, A+team-1) = {cached}")
    assert all(r["usage"]["prompt_tokens"] == PROMPT_TOKENS for r in replies)
    a_first, b_first, a_repeat, b_as_a, b_repeat, a_team = cached
    assert a_first == 0
    assert b_first == 0  # the same prompt, sent by another tenant: no hit
    assert a_repeat >= 384  # the same tenant: a hit
    assert b_as_a == 0  # A's salt in B's body does not reach A's blocks
    assert b_repeat >= 384
    assert a_team == 0  # a body salt partitions inside the tenant
    texts = {r["choices"][0]["text"] for r in replies}
    assert len(texts) == 1  # the salt changes the cache, not the answer


async def test_salts_separate_redis_and_routing(tenant_gateway, redis_cluster, prompt_ids,
                                                redis_server):
    gw, lookups = tenant_gateway
    c = redis_cluster
    prefill_state, _ = await get_states(c)
    model, bs = prefill_state.model, prefill_state.block_size
    quantization = prefill_state.quantization
    assert await index_matches(c)
    expected = {salt: hash_request_tokens(prompt_ids, bs,
                                          block_extra_keys(model, salt, quantization))
                for salt in dict.fromkeys(s for _, _, s in SENDS)}
    held_prefill = await c.index.held_hashes(c.prefill.identity.instance_id)
    held_all = held_prefill | await c.index.held_hashes(c.decode.identity.instance_id)
    for salt, hashes in expected.items():
        assert len(hashes) == PROMPT_TOKENS // bs
        assert set(hashes) <= held_prefill, salt  # each tenant's blocks, under its salt
    salted = [set(h) for h in expected.values()]
    assert sum(map(len, salted)) == len(set().union(*salted))  # pairwise disjoint
    for salt in (None, ""):  # nothing was cached without a tenant salt
        plain = set(hash_request_tokens(prompt_ids, bs,
                                        block_extra_keys(model, salt, quantization)))
        assert not plain & held_all
    # The gateway's routing looked up exactly the salted hashes the engines cached.
    assert set(lookups) == {tuple(h) for h in expected.values()}
    # Neither key is anywhere in Redis (names, members, values).
    r = aioredis.from_url(redis_server.url)
    try:
        dump = b""
        async for name in r.scan_iter():
            kind = await r.type(name)
            dump += name
            if kind == b"string":
                dump += await r.get(name) or b""
            elif kind == b"set":
                dump += b"".join(await r.smembers(name))
        assert dump and KEY_A.encode() not in dump and KEY_B.encode() not in dump
    finally:
        await r.aclose()


async def test_kv_audit_on_real_instances(tenant_gateway, redis_cluster):
    gw, _ = tenant_gateway
    states = await wait_leak_free(redis_cluster)
    assert (await gw.http.get("/debug/kv-audit")).status_code == 401
    assert (await gw.http.get("/debug/kv-audit", headers=_bearer(KEY_B))).status_code == 403
    r = await gw.http.get("/debug/kv-audit", headers=_bearer(ADMIN), timeout=60)
    assert r.status_code == 200, r.text
    report = r.json()
    MEASURED["audit"] = report
    print(f"\nkv-audit: {report}")
    assert report["ok"] is True
    by_role = {i["role"]: i for i in report["instances"]}
    assert len(report["instances"]) == 2 and set(by_role) == {"prefill", "decode"}
    for state in states:
        entry = by_role[state.role]
        assert entry["reachable"] and entry["invariants_ok"], entry
        for field in ("instance_id", "num_gpu_blocks", "num_free_blocks",
                      "num_cached_blocks", "num_used_blocks", "num_pinned_blocks",
                      "num_running", "num_waiting"):
            assert entry[field] == getattr(state, field), (state.role, field)
        assert entry["num_used_blocks"] == entry["num_pinned_blocks"] == 0
        assert entry["num_gpu_blocks"] > 0
    # four salts of one 420-token prompt: 4 x 26 full blocks cached on the prefill
    distinct_salts = len({s for _, _, s in SENDS})
    assert by_role["prefill"]["num_cached_blocks"] >= distinct_salts * (PROMPT_TOKENS // 16)
