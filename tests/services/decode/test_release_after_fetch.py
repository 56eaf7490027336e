"""ReleaseKV goes out as soon as the KV transfer ends, not when the decode does.

While a long split request is still decoding, the prefill instance pins nothing, the prompt's
blocks are back in its free queue (still cached, so evictable and reusable), the prefill gets
exactly one ReleaseKV for the request (answered released=True: not an expired pin), and the
output stays token-identical to the single-process engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc
import pytest

from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.sampling_params import SamplingParams
from tests.services.helpers import RPC_TIMEOUT, greedy, num_handle_blocks, wait_leak_free

pytestmark = pytest.mark.asyncio(loop_scope="session")

NUM_TOKENS = 96
"""Long enough that the decode runs for seconds after the transfer (about 6 s on 2 CPU cores)."""
PIN_TTL_S = 3.0
"""Shorter than the decode here: a pin held for the whole decode expires (logged, and the
late ReleaseKV answers released=False); a faster machine still sees it pinned mid-decode."""
POLL_BOUND_S = 20.0


@pytest.fixture
def short_pin_ttl(cluster):
    worker = cluster.prefill.worker
    config = worker.config
    worker.config = dataclasses.replace(config, kv_pin_ttl=PIN_TTL_S)
    yield
    worker.config = config


@pytest.fixture
def releases(cluster, monkeypatch) -> list[tuple[str, bool]]:
    """(request_id, released) of every ReleaseKV the prefill instance serves."""
    worker = cluster.prefill.worker
    real_release = worker.release
    seen: list[tuple[str, bool]] = []

    async def recording_release(request_id: str) -> bool:
        released = await real_release(request_id)
        seen.append((request_id, released))
        return released

    monkeypatch.setattr(worker, "release", recording_release)
    return seen


def _free_cached_op(engine, block_ids: list[int], block_hashes: list[bytes]) -> list[bool]:
    """Per full block of the handle: free (ref_cnt 0, in the free queue) and still cached
    under its hash."""
    pool = engine.kv_cache_manager.block_pool
    free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    out = []
    for block_id, block_hash in zip(block_ids, block_hashes):
        block = pool.blocks[block_id]
        out.append(block.ref_cnt == 0 and block_id in free
                   and pool.get_cached_block(block_hash) is block)
    return out


async def test_prefill_blocks_are_released_while_the_decode_runs(
        cluster, parity_prompt_ids, reference_llm, short_pin_ttl, releases, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.services.prefill.worker")
    prompt = parity_prompt_ids[0]
    # Before anything is in flight: the reference blocks this (the services') event loop.
    ref = reference_llm.generate([{"prompt_token_ids": prompt}],
                                 SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                                ignore_eos=True))
    ref_tokens = ref[0].outputs[0].token_ids
    rid = "release-early"
    params = greedy(NUM_TOKENS, ignore_eos=True)
    resp = await cluster.prefill_stub.Prefill(
        pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params),
        timeout=RPC_TIMEOUT)
    handle = resp.kv_transfer_params
    num_full = len(prompt) // 16
    assert len(handle.block_hashes) == num_full > 0
    state = await cluster.prefill_stub.GetState(pb.GetStateRequest(), timeout=RPC_TIMEOUT)
    assert state.num_pinned_blocks == num_handle_blocks(handle)
    held_block_ids = await cluster.prefill.worker.engine.call(
        lambda e: e.kv_cache_manager.get_block_ids(rid))  # the prefill's own, never sent

    tokens = [resp.first_token_id]
    finished = asyncio.Event()

    async def consume() -> None:
        req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                               output_token_ids=[resp.first_token_id], sampling_params=params,
                               kv_transfer_params=handle)
        async for chunk in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT):
            tokens.extend(chunk.token_ids)
        finished.set()

    stream = asyncio.create_task(consume())
    try:
        deadline = time.monotonic() + POLL_BOUND_S
        while time.monotonic() < deadline and not finished.is_set():
            state = await cluster.prefill_stub.GetState(pb.GetStateRequest(),
                                                        timeout=RPC_TIMEOUT)
            if state.num_pinned_blocks == 0:
                break
            await asyncio.sleep(0.02)
        num_tokens_then = len(tokens)
        blocks_free = await cluster.prefill.worker.engine.call(
            lambda e: _free_cached_op(e, held_block_ids, list(handle.block_hashes)))
        decode_state = await cluster.decode_stub.GetState(pb.GetStateRequest(),
                                                          timeout=RPC_TIMEOUT)
        # Unpinned while the decode is still running, not at its end.
        assert state.num_pinned_blocks == 0
        # (waiting: the fetch is done and the release answered before its first decode step)
        assert num_tokens_then < NUM_TOKENS
        assert decode_state.num_running + decode_state.num_waiting == 1, decode_state
        assert state.num_used_blocks == 0
        assert blocks_free == [True] * num_full
        await asyncio.wait_for(stream, RPC_TIMEOUT)
    finally:
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)

    assert tokens == ref_tokens
    assert len(tokens) == NUM_TOKENS
    # Exactly one ReleaseKV, and it found the pin (it had not expired); no pin expired.
    # The decode's background calls (a second ReleaseKV would be one) are all done then.
    await asyncio.wait_for(asyncio.gather(*cluster.decode.worker._tasks), RPC_TIMEOUT)
    assert [r for r in releases if r[0] == rid] == [(rid, True)]
    assert not [r for r in caplog.records if "expired" in r.getMessage() and rid in
                r.getMessage()]
    prefill_state, decode_state = await wait_leak_free(cluster)
    assert prefill_state.num_pinned_blocks == prefill_state.num_used_blocks == 0
    assert decode_state.num_used_blocks == 0
    assert prefill_state.invariants_ok and decode_state.invariants_ok


async def test_a_failed_transfer_releases_once(cluster, releases):
    # The pin is gone before the decode fetches: FetchKV answers NOT_FOUND, the decode sends
    # its one ReleaseKV (released=False: nothing left to unpin) and no second one on the
    # way out.
    rid = "release-failed"
    prompt = list(range(700, 740))
    params = greedy(8)
    resp = await cluster.prefill_stub.Prefill(
        pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params),
        timeout=RPC_TIMEOUT)
    await cluster.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id=rid),
                                         timeout=RPC_TIMEOUT)
    req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                           output_token_ids=[resp.first_token_id], sampling_params=params,
                           kv_transfer_params=resp.kv_transfer_params)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT):
            pass
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    await asyncio.wait_for(asyncio.gather(*cluster.decode.worker._tasks), RPC_TIMEOUT)
    assert [r for r in releases if r[0] == rid] == [(rid, True), (rid, False)]
    prefill_state, decode_state = await wait_leak_free(cluster)
    assert prefill_state.num_pinned_blocks == prefill_state.num_used_blocks == 0
    assert decode_state.num_used_blocks == 0
