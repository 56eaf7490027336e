"""Admission order: shortest-job-first with an aging bound (default) and FCFS."""

from __future__ import annotations

import time

from pdserve.shared.config import SchedulerConfig
from pdserve.shared.engine.scheduler import Scheduler
from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.request import Request, RequestStatus
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.engine.test_scheduler import runner_output

BS = 16


def _scheduler(policy="sjf", max_wait_s=10.0, max_num_seqs=1, num_blocks=64,
               budget=512) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=False, model_name="m")
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=512, scheduling_policy=policy,
                             max_wait_s=max_wait_s)
    return Scheduler(config, kv)


def _request(request_id: str, prompt_len: int, max_tokens: int = 4) -> Request:
    prompt = [(i * 7 + len(request_id)) % 90 + 1 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens))


def _admission_sequence(scheduler: Scheduler) -> list[str]:
    """Run to completion (one request at a time), recording who starts when."""
    started: list[str] = []
    for _ in range(200):
        out = scheduler.schedule()
        if not out.scheduled:
            break
        for s in out.scheduled:
            if s.start_pos == 0:
                started.append(s.request.request_id)
        scheduler.update_from_output(out, runner_output({s.request.request_id: 5
                                           for s in out.scheduled if s.sample}))
    assert not scheduler.has_unfinished_requests()
    return started


def test_sjf_admits_the_shortest_prompt_first():
    scheduler = _scheduler()
    for request_id, n in (("long", 300), ("short", 20), ("mid", 120), ("short2", 20)):
        scheduler.add_request(_request(request_id, n))
    # Ties keep arrival order.
    assert _admission_sequence(scheduler) == ["short", "short2", "mid", "long"]


def test_fcfs_keeps_arrival_order():
    scheduler = _scheduler(policy="fcfs")
    for request_id, n in (("long", 300), ("short", 20), ("mid", 120)):
        scheduler.add_request(_request(request_id, n))
    assert _admission_sequence(scheduler) == ["long", "short", "mid"]


def test_a_request_waiting_past_the_bound_goes_first():
    scheduler = _scheduler(max_wait_s=5.0)
    old = _request("old-long", 300)
    old.arrival_time = time.monotonic() - 6.0
    older = _request("older-long", 200)
    older.arrival_time = time.monotonic() - 7.0
    scheduler.add_request(_request("short", 20))
    scheduler.add_request(old)
    scheduler.add_request(older)
    # Overdue requests in arrival order, then the rest shortest first.
    assert _admission_sequence(scheduler) == ["older-long", "old-long", "short"]


def test_sjf_counts_tokens_left_not_prompt_length():
    """A request arriving with its prompt's KV already written (a transfer) has one token
    left to compute: it overtakes a short prompt that still needs its prefill."""
    scheduler = _scheduler()
    scheduler.add_request(_request("local", 40))
    transferred = _request("transferred", 200)
    blocks = scheduler.kv_cache_manager.allocate_slots(transferred, 200)
    assert blocks is not None
    transferred.num_computed_tokens = 200
    transferred.append_output_token(9, None)  # the prefill service's first token
    scheduler.add_request(transferred)
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["transferred"]


def test_preempted_requests_resume_before_shorter_ones():
    # 11 usable blocks: "a" may grow to 8 blocks and "b" to 5, so their decodes preempt
    # the newest running request; a short newcomer is then admitted only after it.
    scheduler = _scheduler(max_num_seqs=4, num_blocks=12, budget=512)
    scheduler.add_request(_request("a", 80, max_tokens=40))
    scheduler.add_request(_request("b", 30, max_tokens=40))
    preempted = None
    for _ in range(100):
        out = scheduler.schedule()
        if out.preempted_request_ids:
            preempted = out.preempted_request_ids[0]
            break
        scheduler.update_from_output(out, runner_output({s.request.request_id: 5
                                           for s in out.scheduled if s.sample}))
    assert preempted is not None
    victim = scheduler.requests[preempted]
    assert victim.status == RequestStatus.PREEMPTED
    scheduler.add_request(_request("tiny", 4))
    assert scheduler._admission_order()[0] is victim


def _prioritized(request_id: str, prompt_len: int, priority: int,
                 max_tokens: int = 4) -> Request:
    prompt = [(i * 7 + len(request_id)) % 90 + 1 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, priority=priority))


def test_priority_admits_the_lowest_priority_value_first_then_by_arrival():
    scheduler = _scheduler(policy="priority")
    for request_id, n, priority in (("late-low", 20, 5), ("long-urgent", 300, -1),
                                    ("mid", 120, 0), ("short", 20, 0)):
        scheduler.add_request(_prioritized(request_id, n, priority))
        time.sleep(0.001)  # distinct arrival times
    # priority first (not length), arrival breaks ties (not length either)
    assert _admission_sequence(scheduler) == ["long-urgent", "mid", "short", "late-low"]


def test_priority_preempts_the_lowest_priority_running_request_first():
    # 6 usable blocks: three 2-block prompts that each grow past their blocks
    scheduler = _scheduler(policy="priority", max_num_seqs=3, num_blocks=7)
    for request_id, priority in (("low", 3), ("high", -2), ("mid", 0)):
        scheduler.add_request(_prioritized(request_id, 32, priority, max_tokens=40))
        time.sleep(0.001)
    first = scheduler.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["high", "mid", "low"]
    assert [r.request_id for r in scheduler.running] == ["high", "mid", "low"]
    scheduler.update_from_output(first, runner_output({s.request.request_id: 5
                                         for s in first.scheduled if s.sample}))
    # the next token of each needs a third block: only the highest priorities keep theirs
    out = scheduler.schedule()
    assert out.preempted_request_ids[0] == "low"
    assert "high" in [s.request.request_id for s in out.scheduled]
    scheduler.update_from_output(out, runner_output({s.request.request_id: 5
                                       for s in out.scheduled if s.sample}))
    for _ in range(400):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output({s.request.request_id: 5
                                           for s in out.scheduled if s.sample}))
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0
