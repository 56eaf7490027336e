"""The gateway hashes a request's prompt once (issue 33): its n choices and every retry of
each read the same block hashes for placement, and the one in-flight count per instance is
back at zero when the request is done (fake split engine over real gRPC)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.services.gateway import placement
from tests.services.gateway.conftest import running_gateway
from tests.services.gateway.fake_engine import start_fake_cluster
from tests.services.gateway.helpers import CHAT, chat_body

pytestmark = pytest.mark.asyncio


class _RecordingRegistry:
    """No live instance (placement uses the static lists); records each prefix lookup."""

    def __init__(self) -> None:
        self.lookups: list[tuple[bytes, ...]] = []

    async def live_instances(self, role=None) -> list:
        return []

    async def longest_prefix(self, block_hashes) -> dict[str, int]:
        self.lookups.append(tuple(block_hashes))
        return {}


async def test_prompt_hashed_once_for_every_choice_and_retry(model_path, fake_model,
                                                             monkeypatch):
    calls: list[int] = []
    real = placement.hash_request_tokens

    def counting(token_ids, block_size, extra_keys=()):
        calls.append(len(token_ids))
        return real(token_ids, block_size, extra_keys)

    monkeypatch.setattr(placement, "hash_request_tokens", counting)
    cluster = await start_fake_cluster(fake_model, num_prefill=2, num_decode=1)
    try:
        async with running_gateway(model_path, cluster) as gw:
            registry = gw.app.state.gateway.engine.placer.registry = _RecordingRegistry()
            cluster.prefills[0].rec.fail_with = grpc.StatusCode.UNAVAILABLE  # retried
            body = chat_body("Count from one to twenty, slowly, one number per line, " * 3,
                             n=3, max_tokens=4, temperature=0)
            r = await gw.http.post(CHAT, json=body)
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 3
            placer = gw.app.state.gateway.engine.placer
            channels = gw.app.state.gateway.engine.channels
            assert placer.in_flight is channels.in_flight  # one count per instance
            assert all(placer.in_flight[a] == 0
                       for a in cluster.prefill_urls + cluster.decode_urls)
        stats = gw.app.state.gateway.engine.failover_stats
        assert stats.prefill_retries >= 1  # at least one choice was placed twice
        assert len(registry.lookups) >= 4  # 3 choices + their retries
        assert len(set(registry.lookups)) == 1 and len(registry.lookups[0]) >= 1
        assert len(calls) == 1  # hashed once for all of them
    finally:
        await cluster.stop()
