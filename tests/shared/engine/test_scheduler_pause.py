"""Scheduler pause/resume (engine-side backpressure): not scheduled, keeps its blocks and its
place, not counted against max_num_seqs, preemptible, abortable, idempotent."""

from __future__ import annotations

from shared.request import RequestStatus
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
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
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
