"""200 requests cancelled at random points (during the prefill, during the KV transfer,
during decode, by an Abort RPC, or not at all): afterwards no pool has a block in use or
pinned, and Redis holds exactly the hashes each instance still caches."""

from __future__ import annotations

import asyncio
import collections
import random

import grpc
import pytest

from pdserve.services.proto import engine_pb2 as pb
from tests.services.helpers import (
    NOT_FINISHED,
    RPC_TIMEOUT,
    greedy,
    index_matches,
    wait_leak_free,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

KINDS = ("prefill", "transfer", "decode", "abort_rpc", "complete")


async def _abort(cluster, request_id: str) -> None:
    req = pb.AbortRequest(request_ids=[request_id])
    await asyncio.gather(cluster.prefill_stub.Abort(req, timeout=RPC_TIMEOUT),
                         cluster.decode_stub.Abort(req, timeout=RPC_TIMEOUT))


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _one(cluster, i: int, rng: random.Random, outcomes: collections.Counter) -> None:
    kind = KINDS[i % len(KINDS)]
    rid = f"abort-{i}"
    n = rng.randrange(100, 180) if i % 10 == 0 else rng.randrange(8, 60)
    prompt = [rng.randrange(100, 40000) for _ in range(n)]
    params = greedy(rng.randrange(2, 8), ignore_eos=True)
    md = (("x-request-id", rid),)
    prefill = asyncio.ensure_future(cluster.prefill_stub.Prefill(pb.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling_params=params),
        timeout=RPC_TIMEOUT, metadata=md))
    if kind == "prefill":
        await asyncio.sleep(rng.uniform(0, 0.05))
        await _cancel(prefill)
        await _abort(cluster, rid)
        outcomes[kind] += 1
        return
    resp = await prefill
    call = cluster.decode_stub.Generate(pb.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, output_token_ids=[resp.first_token_id],
        sampling_params=params, kv_transfer_params=resp.kv_transfer_params),
        timeout=RPC_TIMEOUT, metadata=md)
    chunks: list[pb.TokenChunk] = []

    async def read(limit: int | None) -> None:
        async for chunk in call:
            chunks.append(chunk)
            if limit is not None and len(chunks) >= limit:
                return

    if kind == "transfer":
        reader = asyncio.ensure_future(read(None))
        await asyncio.sleep(rng.uniform(0, 0.04))
        await _cancel(reader)
        call.cancel()
        await _abort(cluster, rid)
    elif kind == "decode":
        await read(rng.randrange(1, 3))
        call.cancel()
        await _abort(cluster, rid)
    elif kind == "abort_rpc":
        await read(1)
        await cluster.decode_stub.Abort(pb.AbortRequest(request_ids=[rid]), timeout=RPC_TIMEOUT)
        await read(None)
        assert chunks[-1].finish_reason != NOT_FINISHED
    else:
        await read(None)
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert 1 + sum(len(c.token_ids) for c in chunks) == params.max_tokens
    outcomes[kind] += 1


async def test_random_aborts_leave_no_block_behind(cluster):
    worker = cluster.decode.worker
    rng = random.Random(20261129)
    fetch = worker.fetcher.fetch

    async def slow_fetch(*args, **kwargs):
        # Widen the transfer window so that cancellations land inside it.
        await asyncio.sleep(rng.uniform(0, 0.03))
        return await fetch(*args, **kwargs)

    worker.fetcher.fetch = slow_fetch
    outcomes: collections.Counter = collections.Counter()
    semaphore = asyncio.Semaphore(32)

    async def run(i: int) -> None:
        async with semaphore:
            try:
                await _one(cluster, i, random.Random(rng.random()), outcomes)
            except grpc.aio.AioRpcError as e:  # an abort may win the race: ABORTED is fine
                assert e.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED), e
                outcomes["rpc-" + e.code().name] += 1

    try:
        await asyncio.gather(*(run(i) for i in range(200)))
    finally:
        del worker.fetcher.fetch
    assert sum(outcomes.values()) == 200
    prefill_state, decode_state = await wait_leak_free(cluster)
    for state in (prefill_state, decode_state):
        assert state.num_used_blocks == 0, state
        assert state.num_pinned_blocks == 0, state
        assert state.num_running == state.num_waiting == 0, state
        assert state.invariants_ok, state.invariants_error
    # The prompts held far more blocks than a pool has: evictions happened on both sides,
    # and Redis saw them.
    if cluster.index is not None:
        assert await index_matches(cluster)
