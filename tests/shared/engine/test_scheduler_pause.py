"""Scheduler pause/resume (engine-side backpressure): not scheduled, keeps its blocks and its
place, not counted against max_num_seqs, preemptible, abortable, idempotent."""

from __future__ import annotations

import pytest

from pdserve.shared.llm import LLM
from pdserve.shared.request import Request, RequestStatus
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.engine.test_scheduler import (
    FakeRunner,
    check,
    make_request,
    make_scheduler,
    run_all,
    step,
)


def _reference_tokens(prompt_lens: dict[str, int], max_tokens: int) -> dict[str, list[int]]:
    sched = make_scheduler(num_blocks=64)
    reqs = [make_request(rid, n, max_tokens=max_tokens) for rid, n in prompt_lens.items()]
    for r in reqs:
        sched.add_request(r)
    run_all(sched, FakeRunner(sched))
    return {r.request_id: r.output_token_ids for r in reqs}


def test_paused_request_is_not_scheduled_keeps_its_blocks_and_resumes_where_it_was():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(sched)
    a, b = make_request("a", 20, max_tokens=6), make_request("b", 20, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # a prefilled (max_num_seqs=1: b waits)
    step(sched, runner)
    blocks, computed, tokens = sched.kv_cache_manager.get_block_ids("a"), \
        a.num_computed_tokens, list(a.output_token_ids)
    assert sched.pause_requests(["a", "a", "nope"]) == ["a"]
    assert sched.pause_requests(["a"]) == []  # idempotent
    assert sched.make_stats().num_paused == 1 and sched.num_running == 0
    for _ in range(3):  # b takes the only seat; a stays put
        out, _ = step(sched, runner)
        assert "a" not in [s.request.request_id for s in out.scheduled]
    assert b.status == RequestStatus.RUNNING
    assert sched.kv_cache_manager.get_block_ids("a") == blocks
    assert (a.num_computed_tokens, a.output_token_ids) == (computed, tokens)
    run_all(sched, runner)  # only a is left, paused: no work
    assert b.is_finished and not a.is_finished and not sched.has_unfinished_requests()
    assert sched.resume_requests(["a", "a", "b"]) == ["a"]
    run_all(sched, runner)
    assert a.is_finished and a.num_preemptions == 0
    ref = _reference_tokens({"a": 20, "b": 20}, 6)
    assert a.output_token_ids == ref["a"] and b.output_token_ids == ref["b"]
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_paused_request_is_preempted_first_and_recomputed_with_the_same_tokens():
    # 12 usable blocks: a and b (70-token prompts) hold 10, c needs 5: someone must give.
    sched = make_scheduler(num_blocks=13, max_num_batched_tokens=256)
    runner = FakeRunner(sched)
    reqs = [make_request(rid, 70, max_tokens=20) for rid in "abc"]
    for r in reqs[:2]:
        sched.add_request(r)
    step(sched, runner)
    step(sched, runner)
    sched.pause_requests(["a"])
    sched.add_request(reqs[2])  # needs a's blocks: a (paused) is preempted, not b
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["a"] and "c" in [s.request.request_id
                                                          for s in out.scheduled]
    a = reqs[0]
    # Paused is a state of its own: preempted while paused, it stays PAUSED (its KV gone).
    assert a.status == RequestStatus.PAUSED and a.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("a") == [] and "a" in sched.paused
    assert reqs[1].num_preemptions == 0
    sched.resume_requests(["a"])
    run_all(sched, runner)
    ref = _reference_tokens({rid: 70 for rid in "abc"}, 20)
    assert {r.request_id: r.output_token_ids for r in reqs} == ref
    assert sched.kv_cache_manager.num_free_blocks == 12


def test_abort_or_pause_of_finished_while_paused_frees_everything():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    a, b = make_request("a", 40), make_request("b", 40)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    sched.pause_requests(["a", "b"])
    assert sched.abort_requests(["a"]) == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED and "a" not in sched.paused
    assert sched.kv_cache_manager.get_block_ids("a") == []
    assert sched.resume_requests(["a"]) == [] and sched.pause_requests(["a"]) == []
    sched.resume_requests(["b"])
    run_all(sched, runner)
    assert sched.pause_requests(["b"]) == [] and sched.resume_requests(["b"]) == []
    assert not sched.paused and sched.kv_cache_manager.num_free_blocks == 63
    check(sched)


def test_request_paused_while_waiting_keeps_its_turn_and_frees_a_seat():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    reqs = [make_request(rid, 8, max_tokens=4) for rid in "abc"]
    for r in reqs:
        sched.add_request(r)
    sched.pause_requests(["a"])  # before admission: b and c take the two seats
    out, _ = step(sched, runner)
    assert sorted(s.request.request_id for s in out.scheduled) == ["b", "c"]
    assert sched.num_waiting == 0 and sched.kv_cache_manager.get_block_ids("a") == []
    sched.resume_requests(["a"])
    run_all(sched, runner)
    assert all(r.is_finished for r in reqs) and sched.kv_cache_manager.num_free_blocks == 63


@pytest.mark.fp32_only  # the reference is transformers' fp32 model
def test_paused_preempted_resumed_matches_transformers(model_path, parity_prompt_ids,
                                                       hf_greedy_reference):
    # The real model: request 0 paused after 10 tokens, its KV freed (preempted while
    # paused) and recomputed on resume; request 1 runs alone meanwhile. Both greedy answers
    # stay transformers' token for token.
    llm = LLM(model_path, kv_cache_memory="64MiB", max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24)  # a prefix of the reference
    reqs = [Request(f"r{i}", ids, params, eos_token_id=llm.eos_token_id)
            for i, ids in enumerate(parity_prompt_ids[:2])]
    for r in reqs:
        engine.add_request(r)
    while reqs[0].num_output_tokens < 10:
        engine.step()
    assert engine.scheduler.pause_requests(["r0"]) == ["r0"]
    for _ in range(5):
        engine.step()
    assert reqs[0].num_output_tokens == 10 and reqs[1].num_output_tokens > 10
    assert engine.scheduler.preempt_paused() and reqs[0].num_computed_tokens == 0
    assert engine.scheduler.resume_requests(["r0"]) == ["r0"]
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids for r in reqs] == [ref[:24] for ref in hf_greedy_reference[:2]]
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_gpu_blocks - 1
