"""Two stacks on one host share its cores and never starve each other.

Four real engine processes on one core-share board, as two `pdserve up` on one machine
share /dev/shm's: stack A (prefill + decode) serves a lone long request while stack B's
32 concurrent streams keep its engines busy, half of them aborted after a few tokens and
replaced. The lone request must complete, in about its time alone plus B's fair share of
the cores (two busy stacks: about half the machine each), and nothing may wait unboundedly
(before the bounded waiting, such a request was left waiting in A's decode for minutes:
its engine yielded its turn to B's shorter prefills again and again).
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from tests.procs import ServiceGroup

pytestmark = pytest.mark.slow

LONG_PROMPT = [random.Random(7).randrange(100, 40000) for _ in range(1478)]
LONE_TOKENS = 16
NUM_STREAMS = 32
HARD_LIMIT_S = 300.0
"""Nothing waits unboundedly: the lone request's own deadline."""


async def _split(prefill: str, decode: str, request_id: str, prompt: list[int],
                 max_tokens: int, abort_after: int | None = None) -> int:
    """The gateway's flow over gRPC; returns the tokens received (cancels the decode
    stream after `abort_after` chunks when given, as a disconnecting client does)."""
    params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(prefill) as pch, \
            grpc.aio.insecure_channel(decode) as dch:
        first = await engine_pb2_grpc.PrefillServiceStub(pch).Prefill(
            pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                              sampling_params=params), timeout=HARD_LIMIT_S)
        call = engine_pb2_grpc.DecodeServiceStub(dch).Generate(
            pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                             output_token_ids=[first.first_token_id], sampling_params=params,
                             kv_transfer_params=first.kv_transfer_params),
            timeout=HARD_LIMIT_S)
        received, chunks = 1, 0
        async for chunk in call:
            received += len(chunk.token_ids)
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                call.cancel()
                break
        return received


async def _stack_b_load(prefill: str, decode: str, stop: asyncio.Event) -> int:
    """NUM_STREAMS streams at all times, every other one aborted after 3 chunks; returns how
    many were started."""
    rng = random.Random(0)
    started = 0

    async def one(k: int) -> None:
        nonlocal started
        while not stop.is_set():
            started += 1
            prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(20, 200))]
            try:
                await _split(prefill, decode, f"b-{k}-{started}", prompt, 48,
                             abort_after=3 if started % 2 else None)
            except grpc.aio.AioRpcError:
                pass  # a cancelled call; the load goes on

    await asyncio.gather(*(one(k) for k in range(NUM_STREAMS)))
    return started


async def _lone(prefill: str, decode: str, request_id: str) -> float:
    start = time.monotonic()
    received = await asyncio.wait_for(
        _split(prefill, decode, request_id, LONG_PROMPT, LONE_TOKENS), HARD_LIMIT_S)
    assert received == LONE_TOKENS
    return time.monotonic() - start


async def _scenario(a: tuple[str, str], b: tuple[str, str]) -> tuple[float, float, int]:
    await _lone(*a, "warm-up")
    alone = await _lone(*a, "alone")
    stop = asyncio.Event()
    load = asyncio.create_task(_stack_b_load(*b, stop))
    await asyncio.sleep(3.0)  # B's streams are running
    try:
        loaded = await _lone(*a, "beside-b")
    finally:
        stop.set()
        started = await asyncio.wait_for(load, HARD_LIMIT_S)
    return alone, loaded, started


def test_a_lone_long_request_beside_another_stacks_abort_storm(model_path, tmp_path):
    board = str(tmp_path / "board")
    flags = ("--core-share", board, "--kv-cache-memory", "192MiB")
    with ServiceGroup(tmp_path) as group:
        a = (group.start("prefill", model_path, *flags), group.start("decode", model_path, *flags))
        b = (group.start("prefill", model_path, *flags), group.start("decode", model_path, *flags))
        group.wait_serving(timeout=400)
        alone, loaded, started = asyncio.run(_scenario(
            (a[0].address, a[1].address), (b[0].address, b[1].address)))
        for p in (*a, *b):
            assert p.alive, p.log_tail()
    print(f"lone request: alone {alone:.2f} s, beside stack B {loaded:.2f} s "
          f"({loaded / alone:.2f}x); B started {started} streams")
    assert started >= NUM_STREAMS
    # Its time alone plus B's fair share (two busy stacks: each about half the cores), with
    # room for a shared 2-core machine's noise; never the minutes it waited before.
    assert loaded <= 3.0 * alone + 10.0, (alone, loaded)
