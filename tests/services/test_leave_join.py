"""Graceful leave with a real Redis: an instance told to stop leaves the registry at once
(gateways stop placing there) while it finishes what it holds: a draining prefill still
serves the FetchKV of the KV it has pinned and stops as soon as those pins are released; a
draining decode finishes its streams. (Joining: tests/e2e/test_multihost.py.)"""

from __future__ import annotations

import asyncio
import shutil
import time

import grpc
import pytest
import pytest_asyncio

from pdserve.services.proto import engine_pb2 as pb
from tests.services.helpers import (
    NOT_FINISHED,
    RPC_TIMEOUT,
    RedisServer,
    greedy,
    start_cluster,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
GRACE = 60.0
"""Far longer than anything here takes: a stop that returns early drained on its own."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def redis_url():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer()
    server.start()
    yield server.url
    server.stop()


async def _registered(index, role: str) -> list[str]:
    return [i.instance_id for i in await index.live_instances(role)]


async def test_draining_instances_leave_the_registry_at_once_and_finish_their_work(
        model_path, redis_url):
    c = await start_cluster(model_path, redis_url, kv_cache_memory="128MiB")
    try:
        for r in c.runtimes:
            await r.monitor.flush()
        prefill_id, decode_id = (r.identity.instance_id for r in c.runtimes)
        assert await _registered(c.index, "prefill") == [prefill_id]
        assert await _registered(c.index, "decode") == [decode_id]

        # A prefill leaves with KV pinned: unregistered at once, FetchKV still served.
        prompt = list(range(300, 380))
        params = greedy(24, ignore_eos=True)
        resp = await c.prefill_stub.Prefill(pb.PrefillRequest(
            request_id="leave-p", prompt_token_ids=prompt, sampling_params=params),
            timeout=RPC_TIMEOUT)
        assert resp.finish_reason == NOT_FINISHED
        started = time.monotonic()
        stopping = asyncio.ensure_future(c.prefill.stop(GRACE))
        await asyncio.sleep(0.3)
        assert await _registered(c.index, "prefill") == []
        assert await c.index.held_hashes(prefill_id) == set()
        assert not stopping.done(), "the prefill must wait for its pinned KV"
        stream = c.decode_stub.Generate(pb.DecodeRequest(
            request_id="leave-p", prompt_token_ids=prompt,
            output_token_ids=[resp.first_token_id], sampling_params=params,
            kv_transfer_params=resp.kv_transfer_params), timeout=RPC_TIMEOUT)
        first = await stream.read()
        await asyncio.wait_for(stopping, GRACE / 2)  # pins released: the drain ends early
        assert time.monotonic() - started < GRACE / 2

        # A decode leaves mid-stream: unregistered at once, the stream runs to its end.
        stopping = asyncio.ensure_future(c.decode.stop(GRACE))
        await asyncio.sleep(0.3)
        assert await _registered(c.index, "decode") == []
        rest = []
        while (chunk := await stream.read()) is not grpc.aio.EOF:
            rest.append(chunk)
        tokens = [*first.token_ids, *(t for ch in rest for t in ch.token_ids)]
        assert len(tokens) == 23 and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        await asyncio.wait_for(stopping, GRACE / 2)
    finally:
        await c.close()

