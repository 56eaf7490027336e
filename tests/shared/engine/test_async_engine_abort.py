"""AsyncEngine aborts on the real model with chunked prefill (64-token chunks): an abort is
answered without waiting for the step in flight, the aborted request's uncomputed chunks are
never scheduled, only the step in flight's chunk counts as computed after the abort, and no
block stays in use, for an abort call as for a consumer that stops; an abort racing with the
step that finishes the request, and one that arrives before the request was added, are safe
too.

A step is held in flight by the engine's fault hook (called on the engine thread before each
step): while it waits, the engine thread is busy exactly as in a long model step."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.shared.engine.async_engine import AsyncEngine
from pdserve.shared.llm import LLM
from pdserve.shared.request import FinishReason, Request
from pdserve.shared.sampling_params import SamplingParams
from tests.step_gate import StepGate

CHUNK = 64
PROMPT = 640  # 10 chunks


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, kv_cache_memory="64MiB", max_model_len=1024, max_num_seqs=8,
               max_num_batched_tokens=CHUNK)


def _request(request_id: str, n: int, max_tokens: int = 4) -> Request:
    prompt = [(7 * i + len(request_id)) % 4000 + 100 for i in range(n)]
    return Request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True))


async def _collect(engine: AsyncEngine, request: Request) -> list:
    return [d async for d in engine.generate(request)]


async def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _assert_nothing_held(core) -> None:
    kv = core.kv_cache_manager
    kv.check_invariants()
    assert not core.scheduler.requests
    assert not kv.req_to_blocks
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_gpu_blocks - 1


@pytest.fixture(scope="module")
def async_engine(llm):
    engine = AsyncEngine(llm.engine, name="abort-test")
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(async_engine):
    yield async_engine
    async_engine.fault_hook = None


async def test_abort_mid_prefill_drops_the_remaining_chunks(engine):
    core = engine.engine_core
    gate = engine.fault_hook = StepGate(hold_at=3)
    request = _request("long", PROMPT)
    consumer = asyncio.ensure_future(_collect(engine, request))
    assert await asyncio.to_thread(gate.entered.wait, 60)
    steps, before = engine.num_steps, core.num_prompt_tokens_after_abort
    computed_at_abort = request.num_computed_tokens

    # The engine thread is held: the abort is answered all the same.
    assert engine.request_abort(["long", "unknown"]) == ["long"]
    assert engine.num_steps == steps and gate.num_calls == 4
    gate.released.set()

    deltas = await asyncio.wait_for(consumer, 60)
    assert [d.finish_reason for d in deltas] == [FinishReason.ABORT]
    # The held step was scheduled before the abort was applied: its chunk is the only one
    # computed after the abort arrived; the rest of the prompt never was.
    assert computed_at_abort == 3 * CHUNK
    assert request.num_computed_tokens == 4 * CHUNK < PROMPT
    assert core.num_prompt_tokens_after_abort - before == CHUNK
    await engine.call(_assert_nothing_held)


async def test_a_consumer_that_stops_mid_prefill_aborts_it_the_same_way(engine):
    core = engine.engine_core
    gate = engine.fault_hook = StepGate(hold_at=2)
    request = _request("cancelled", PROMPT)
    consumer = asyncio.ensure_future(_collect(engine, request))
    assert await asyncio.to_thread(gate.entered.wait, 60)
    before = core.num_prompt_tokens_after_abort
    consumer.cancel()  # a cancelled RPC: the stream's cleanup aborts the request
    await _wait_for(lambda: "cancelled" in engine.aborting)
    gate.released.set()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await _wait_for(lambda: "cancelled" not in engine.aborting)
    assert request.num_computed_tokens == 3 * CHUNK < PROMPT
    assert core.num_prompt_tokens_after_abort - before == CHUNK
    await engine.call(_assert_nothing_held)


async def test_abort_racing_with_the_finishing_step_is_safe(engine):
    core = engine.engine_core
    gate = engine.fault_hook = StepGate(hold_at=0)
    request = _request("short", CHUNK - 8, max_tokens=1)  # one chunk finishes it
    consumer = asyncio.ensure_future(_collect(engine, request))
    assert await asyncio.to_thread(gate.entered.wait, 60)
    before = core.num_prompt_tokens_after_abort
    assert engine.request_abort(["short"]) == ["short"]
    gate.released.set()
    deltas = await asyncio.wait_for(consumer, 60)
    # The step finished it before the abort op ran: a normal end, nothing left behind.
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert core.num_prompt_tokens_after_abort - before == CHUNK - 8
    await engine.call(_assert_nothing_held)


async def test_abort_before_the_request_is_added_skips_it(engine):
    hold, held = threading.Event(), threading.Event()

    def busy(_core) -> None:  # an op holding the engine thread, ahead of the add
        held.set()
        assert hold.wait(60)

    blocker = engine.submit(busy)
    assert await asyncio.to_thread(held.wait, 60)
    request = _request("early", PROMPT)
    consumer = asyncio.ensure_future(_collect(engine, request))
    # Known (its stream is open) once the consumer has started, though not added yet.
    await _wait_for(lambda: engine.request_abort(["early"]) == ["early"])
    hold.set()
    await blocker
    deltas = await asyncio.wait_for(consumer, 60)
    assert [d.finish_reason for d in deltas] == [FinishReason.ABORT]
    assert request.num_computed_tokens == 0
    await engine.call(_assert_nothing_held)
