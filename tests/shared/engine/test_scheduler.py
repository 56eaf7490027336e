"""Scheduler with a fake model runner: budgets, chunking, preemption, aborts, stop rules."""

from __future__ import annotations

import pytest

import pdserve.shared.kv_cache.prefix_hash as prefix_hash_module
from pdserve.shared.config import SchedulerConfig
from pdserve.shared.engine.model_runner_output import ModelRunnerOutput
from pdserve.shared.engine.scheduler import Scheduler, check_stop
from pdserve.shared.engine.scheduling_policy import validate_request
from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.kv_transfer.connector import KVConnector
from pdserve.shared.kv_transfer.params import HeldBlocks, RemoteDecode, RemotePrefill
from pdserve.shared.request import FinishReason, Request, RequestStatus
from pdserve.shared.sampling_params import SamplingParams

BS = 16


def make_scheduler(num_blocks=64, max_num_seqs=16, max_num_batched_tokens=64,
                   max_model_len=256, kv_connector=None, enable_caching=True,
                   long_prefill_token_threshold=0, scheduling_policy="fcfs") -> Scheduler:
    # NOTE: these tests spell out budgets, chunks and preemption step by step in arrival
    # order (FCFS); the default shortest-job-first order has tests of its own
    # (test_scheduling_policy.py).
    kv = KVCacheManager(num_blocks, BS, enable_caching=enable_caching, model_name="m")
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len,
                             long_prefill_token_threshold=long_prefill_token_threshold,
                             scheduling_policy=scheduling_policy)
    return Scheduler(config, kv, kv_connector)


def make_request(request_id, prompt_len=None, prompt=None, eos_token_id=None, **params):
    seed = sum(map(ord, request_id))
    prompt = prompt if prompt is not None else [(7 * i + seed) % 90 + 1
                                                for i in range(prompt_len)]
    params.setdefault("max_tokens", 8)
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id=eos_token_id)


def runner_output(sampled: dict[str, int | list[int]]) -> ModelRunnerOutput:
    """A ModelRunnerOutput without logprobs: request_id -> its token (or, scored with
    drafts, its tokens)."""
    token_ids = [t if isinstance(t, list) else [t] for t in sampled.values()]
    return ModelRunnerOutput(list(sampled), token_ids, [[None] * len(t) for t in token_ids],
                             {}, {})


def model_token(request: Request) -> int:
    """A deterministic 'model': the next token depends on the whole sequence."""
    return (sum(request.all_token_ids) * 31 + request.num_tokens) % 500 + 100


class FakeRunner:
    """Writes (position, token) into a fake paged KV and checks every scheduled request
    reads back exactly its own tokens, through its block_ids, before its new chunk."""

    def __init__(self, scheduler: Scheduler, next_token=model_token):
        self.scheduler = scheduler
        self.next_token = next_token
        self.kv: dict[int, tuple[int, int]] = {}

    def execute(self, out) -> ModelRunnerOutput:
        sampled = {}
        for s in out.scheduled:
            req, start, n = s.request, s.start_pos, s.num_scheduled_tokens
            assert n > 0 and len(s.block_ids) * BS >= start + n
            assert 0 not in s.block_ids
            assert s.sample == (start + n == req.num_tokens)
            for pos in range(start):
                slot = s.block_ids[pos // BS] * BS + pos % BS
                assert self.kv.get(slot) == (pos, req.token_at(pos)), (req.request_id, pos)
            for pos in range(start, start + n):
                self.kv[s.block_ids[pos // BS] * BS + pos % BS] = (pos, req.token_at(pos))
            if s.sample:
                sampled[req.request_id] = self.next_token(req)
        return runner_output(sampled)


def check(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    kv.check_invariants()
    assert len(scheduler.running) <= scheduler.scheduler_config.max_num_seqs
    for r in scheduler.running:
        assert r.status == RequestStatus.RUNNING
        assert len(kv.get_block_ids(r.request_id)) == -(-r.num_computed_tokens // BS)
    for r in scheduler.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens > 0 or kv.get_block_ids(r.request_id) == []
    # The views cover every unfinished request (what the leak audit and the feed rely on).
    assert {v.request_id for v in scheduler.request_views()
            if not RequestStatus.is_finished(v.status)} == set(scheduler.requests)


def step(scheduler: Scheduler, runner: FakeRunner):
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == sum(s.num_scheduled_tokens for s in out.scheduled)
    assert out.total_num_scheduled_tokens <= scheduler.scheduler_config.max_num_batched_tokens
    check(scheduler)
    deltas = scheduler.update_from_output(out, runner.execute(out))
    check(scheduler)
    return out, deltas


def run_all(scheduler: Scheduler, runner: FakeRunner, max_steps=2000) -> list:
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outs
        outs.append(step(scheduler, runner))
    raise AssertionError("requests did not finish")


def shape(out) -> list[tuple[str, int, int, bool]]:
    return [(s.request.request_id, s.start_pos, s.num_scheduled_tokens, s.sample)
            for s in out.scheduled]


# -- admission ------------------------------------------------------------------------------

def test_add_request_refuses_a_duplicate_id():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", 10))
    assert sched.num_waiting == 1


def test_validate_request():
    """EngineCore.add_request's one validator (scheduling_policy.validate_request)."""
    def validate(request, max_model_len=100, num_gpu_blocks=64):
        validate_request(request, 500, max_model_len, BS, num_gpu_blocks)

    with pytest.raises(ValueError, match=r"prompt length 101 .* max_model_len 100"):
        validate(make_request("long", 101))
    with pytest.raises(ValueError, match="prompt_token_ids.*empty prompt"):
        validate(make_request("empty", prompt=[]))
    with pytest.raises(ValueError, match=r"prompt_token_ids: token id 500 .*vocabulary"):
        validate(make_request("vocab", prompt=[1, 500]))
    resumed = make_request("resumed", 10, max_tokens=3)
    resumed.output_token_ids = [1, 2, 3]
    with pytest.raises(ValueError, match="output_token_ids: 3 tokens already reach max_tokens=3"):
        validate(resumed)
    resumed.output_token_ids = [1, 600]
    with pytest.raises(ValueError, match="output_token_ids: token id 600"):
        validate(resumed)
    resumed.output_token_ids = [1] * 90
    with pytest.raises(ValueError, match=r"\(100 tokens\) reach max_model_len 100"):
        validate(resumed)
    # 3 usable blocks = 48 tokens
    with pytest.raises(ValueError, match="KV blocks"):
        validate(make_request("big", 40, max_tokens=10), 1000, 4)
    validate(make_request("fits", 40, max_tokens=9), 1000, 4)  # 48 KV tokens at most


def test_prompt_of_exactly_max_model_len_gets_one_token():
    sched = make_scheduler(max_model_len=40, max_num_batched_tokens=64)
    req = make_request("a", 40, max_tokens=None)
    sched.add_request(req)
    outs = run_all(sched, FakeRunner(sched))
    assert len(outs) == 1 and req.num_output_tokens == 1
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_single_request_lifecycle():
    sched = make_scheduler(max_num_batched_tokens=64)
    req = make_request("a", 20, max_tokens=3)
    sched.add_request(req)
    runner = FakeRunner(sched)
    out, deltas = step(sched, runner)
    assert shape(out) == [("a", 0, 20, True)]
    assert out.scheduled[0].block_ids == [1, 2]
    assert req.num_computed_tokens == 20 and req.num_cached_tokens == 0
    assert [d.new_token_ids for d in deltas] == [[req.output_token_ids[0]]]
    assert deltas[0].finish_reason is None and not deltas[0].finished
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 20, 1, True)]
    out, deltas = step(sched, runner)
    assert shape(out) == [("a", 21, 1, True)]
    assert deltas[0].finished and deltas[0].finish_reason == FinishReason.LENGTH
    assert req.num_output_tokens == 3 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.kv_cache_manager.num_free_blocks == 63
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.scheduled == [] and out.finished_request_ids == ["a"]
    assert sched.schedule().finished_request_ids == []


# -- budgets and chunking -------------------------------------------------------------------

def test_token_budget_exhaustion_and_running_first():
    sched = make_scheduler(max_num_batched_tokens=10)
    for rid in ("r0", "r1", "r2"):
        sched.add_request(make_request(rid, 6))
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    assert shape(out) == [("r0", 0, 6, True), ("r1", 0, 4, False)]
    assert out.total_num_scheduled_tokens == 10
    assert sched.num_running == 2 and sched.num_waiting == 1
    out, _ = step(sched, runner)
    # Decodes first, then the running prefill chunk, then the newly admitted request.
    assert shape(out) == [("r0", 6, 1, True), ("r1", 4, 2, True), ("r2", 0, 6, True)]
    out, _ = step(sched, runner)
    assert shape(out) == [("r0", 7, 1, True), ("r1", 6, 1, True), ("r2", 6, 1, True)]


def test_chunked_prefill_block_growth():
    sched = make_scheduler(max_num_batched_tokens=16)
    req = make_request("a", 50, max_tokens=2)
    sched.add_request(req)
    runner = FakeRunner(sched)
    shapes, blocks = [], []
    for _ in range(4):
        out, deltas = step(sched, runner)
        shapes += shape(out)
        blocks.append(out.scheduled[0].block_ids)
        assert (deltas != []) == out.scheduled[0].sample
    assert shapes == [("a", 0, 16, False), ("a", 16, 16, False), ("a", 32, 16, False),
                      ("a", 48, 2, True)]
    assert blocks == [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]
    assert req.num_output_tokens == 1


def test_long_prefill_token_threshold_caps_chunks():
    sched = make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=8)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 5))
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 0, 8, False), ("b", 0, 5, True)]
    out, _ = step(sched, runner)
    assert shape(out) == [("b", 5, 1, True), ("a", 8, 8, False)]


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=200)
    reqs = [make_request(f"r{i}", 10, max_tokens=2 + i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 2
    out, _ = step(sched, runner)  # r0 finishes here (2 tokens)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    out, _ = step(sched, runner)
    assert shape(out) == [("r1", 11, 1, True), ("r2", 0, 10, True)]
    run_all(sched, runner)
    assert [r.num_output_tokens for r in reqs] == [2, 3, 4, 5]


# -- preemption -----------------------------------------------------------------------------

def test_preemption_by_recompute_newest_first_and_outputs_unchanged():
    prompts = {f"r{i}": 30 + 5 * i for i in range(4)}

    def run(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=256)
        reqs = [make_request(rid, n, max_tokens=40) for rid, n in prompts.items()]
        for r in reqs:
            sched.add_request(r)
        return sched, reqs, run_all(sched, FakeRunner(sched))

    _, free_reqs, _ = run(64)
    assert all(r.num_preemptions == 0 for r in free_reqs)
    sched, reqs, outs = run(13)  # 12 usable blocks; the 4 need up to 4 + 5 + 5 + 5
    assert sched.num_preemptions > 0
    assert sched.make_stats().num_preemptions == sched.num_preemptions
    first = next(i for i, (o, _) in enumerate(outs) if o.preempted_request_ids)
    out = outs[first][0]
    # Newest (last admitted) first; nothing is admitted in a step that preempts.
    assert out.preempted_request_ids[0] == "r3"
    assert all(s.request.num_preemptions == 0 or s.start_pos > 0 for s in out.scheduled)
    scheduled_before = {s.request.request_id for s in outs[first - 1][0].scheduled}
    assert {s.request.request_id for s in out.scheduled} <= scheduled_before
    # After recompute every request completes with the same tokens as without preemption.
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in free_reqs]
    assert all(r.num_output_tokens == 40 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    assert sched.kv_cache_manager.num_free_blocks == 12


def test_preempted_request_goes_to_the_front_and_blocks_admission_that_step():
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, enable_caching=False)
    a = make_request("a", 16, max_tokens=40)
    b = make_request("b", 16, max_tokens=30)
    c = make_request("c", 5, max_tokens=2)
    for r in (a, b, c):
        sched.add_request(r)
    runner = FakeRunner(sched)
    step(sched, runner)
    step(sched, runner)  # a and b at 2 blocks each: the pool is full
    assert sched.kv_cache_manager.num_free_blocks == 0 and list(sched.waiting) == [c]
    for _ in range(16):
        out = sched.schedule()
        if out.preempted_request_ids:
            break
        sched.update_from_output(out, runner.execute(out))
    assert out.preempted_request_ids == ["b"]
    assert shape(out) == [("a", 32, 1, True)]  # c not admitted, though a seat is free
    assert list(sched.waiting) == [b, c] and sched.running == [a]
    assert out.scheduled[0].block_ids == [1, 3, 4]  # b held [2, 4]: its tail is reused first
    sched.update_from_output(out, runner.execute(out))
    run_all(sched, runner)
    assert [r.num_output_tokens for r in (a, b, c)] == [40, 30, 2]


def test_preempted_request_state_and_recompute_covers_output():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64, enable_caching=False)
    a = make_request("a", 30, max_tokens=40)  # 69 KV tokens at most: 5 blocks
    b = make_request("b", 20, max_tokens=20)  # 39 KV tokens at most: 3 blocks
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    assert [s.block_ids for s in out.scheduled] == [[1, 2], [3, 4]]
    # a takes the last free block at position 32; when b needs its third block at
    # position 32, b is the newest running request, so b preempts itself.
    for _ in range(20):
        out, _ = step(sched, runner)
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["b"]
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert b.num_preemptions == 1 and a.num_preemptions == 0 and sched.num_preemptions == 1
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert sched.kv_cache_manager.get_block_ids("b") == []
    kept = list(b.output_token_ids)
    assert len(kept) == 13  # b sampled 13 tokens before it needed position 32
    # b waits until a is done, then recomputes prompt + output in one chunk.
    for _ in range(40):
        out, _ = step(sched, runner)
        if b.status != RequestStatus.PREEMPTED:
            break
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert shape(out) == [("b", 0, 20 + 13, True)]
    assert b.output_token_ids[:13] == kept and b.num_output_tokens == 14
    run_all(sched, runner)
    assert a.num_output_tokens == 40 and b.num_output_tokens == 20
    assert b.num_preemptions == 1


# -- aborts ---------------------------------------------------------------------------------

def test_abort_frees_blocks_at_once():
    sched = make_scheduler(max_num_batched_tokens=100)
    a, b, c = (make_request(rid, 40) for rid in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    runner = FakeRunner(sched)
    step(sched, runner)  # a and b (40 + 40 < 100) run; c gets a 20-token chunk
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2, 3]
    free_before = sched.kv_cache_manager.num_free_blocks
    aborted = sched.abort_requests(["a", "nope"])
    assert aborted == [a] and a.status == RequestStatus.FINISHED_ABORTED
    assert a.finish_reason == FinishReason.ABORT
    assert sched.kv_cache_manager.num_free_blocks == free_before + 3
    assert sched.kv_cache_manager.get_block_ids("a") == []
    assert a not in sched.running
    sched.kv_cache_manager.check_invariants()
    assert sched.abort_requests("a") == []
    out = sched.schedule()
    assert out.finished_request_ids == ["a"]
    # Abort between schedule() and update_from_output(): its result is dropped.
    assert sched.abort_requests(["b"]) == [b]
    deltas = sched.update_from_output(out, runner.execute(out))
    assert [d.request_id for d in deltas] == ["c"]
    assert b.num_output_tokens == 1
    check(sched)
    run_all(sched, runner)
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 10), make_request("b", 10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, FakeRunner(sched))
    assert sched.abort_requests(["b"]) == [b]
    assert sched.num_waiting == 0 and sched.num_running == 1
    assert b.status == RequestStatus.FINISHED_ABORTED


# -- stop rules -----------------------------------------------------------------------------

def scripted(script: list[int]):
    return lambda request: script[request.num_output_tokens]


@pytest.mark.parametrize("params, script, expected_len, status, stop_reason", [
    (dict(), [5, 6, 2, 7], 3, RequestStatus.FINISHED_STOPPED, None),
    (dict(ignore_eos=True, max_tokens=5), [2, 2, 2, 2, 2, 2], 5,
     RequestStatus.FINISHED_LENGTH_CAPPED, None),
    (dict(min_tokens=3), [2, 2, 2, 2, 9], 3, RequestStatus.FINISHED_STOPPED, None),
    (dict(min_tokens=3), [2, 5, 6, 2, 9], 4, RequestStatus.FINISHED_STOPPED, None),
    (dict(stop_token_ids=[6, 8]), [5, 8, 6], 2, RequestStatus.FINISHED_STOPPED, 8),
    (dict(stop_token_ids=[8], min_tokens=2), [8, 5, 8], 3, RequestStatus.FINISHED_STOPPED, 8),
    (dict(stop_token_ids=[8], ignore_eos=True), [2, 8], 2, RequestStatus.FINISHED_STOPPED, 8),
    (dict(max_tokens=2), [5, 6, 7], 2, RequestStatus.FINISHED_LENGTH_CAPPED, None),
    (dict(max_tokens=2), [5, 2], 2, RequestStatus.FINISHED_STOPPED, None),
])
def test_stop_rules(params, script, expected_len, status, stop_reason):
    sched = make_scheduler()
    params.setdefault("max_tokens", 10)
    req = make_request("a", 5, eos_token_id=2, **params)
    sched.add_request(req)
    outs = run_all(sched, FakeRunner(sched, scripted(script)))
    assert req.output_token_ids == script[:expected_len]
    assert req.status == status and req.stop_reason == stop_reason
    last_delta = outs[-1][1][0]
    assert last_delta.finish_reason == req.finish_reason
    assert last_delta.stop_reason == stop_reason


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=24)
    req = make_request("a", 20, max_tokens=None)
    sched.add_request(req)
    run_all(sched, FakeRunner(sched))
    assert req.num_tokens == 24 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_check_stop_directly():
    req = make_request("a", 3, eos_token_id=2, max_tokens=4, min_tokens=1)
    req.append_output_token(2)
    assert check_stop(req, 100) == (RequestStatus.FINISHED_STOPPED, None)
    req = make_request("b", 3, eos_token_id=2, max_tokens=4, min_tokens=2)
    req.append_output_token(2)
    assert check_stop(req, 100) == (None, None)
    assert check_stop(req, 4) == (RequestStatus.FINISHED_LENGTH_CAPPED, None)


def test_missing_sampled_token_is_an_error():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(out, runner_output({}))


# -- roles ----------------------------------------------------------------------------------

def test_connector_holds_a_remote_decodes_blocks_until_its_transfer_is_done():
    connector = KVConnector()
    sched = make_scheduler(kv_connector=connector)
    req = make_request("a", 40, max_tokens=1)
    req.kv_transfer_params = RemoteDecode()
    sched.add_request(req)
    _, deltas = step(sched, FakeRunner(sched))
    assert deltas[0].finished and not sched.has_unfinished_requests()
    kv = sched.kv_cache_manager
    assert kv.get_block_ids("a") == [1, 2, 3] and kv.num_free_blocks == 60
    assert req.kv_transfer_params == HeldBlocks(req.block_hashes[:2])
    assert sched.abort_requests(["a"]) == []  # finished: the connector's to close
    assert kv.num_free_blocks == 60
    assert sched.schedule().finished_request_ids == ["a"]
    assert connector.start_send("a") == [1, 2, 3]  # a FetchKV reads the blocks
    assert connector.close("a") == (True, False)  # released mid-read: not done yet
    sched.update_from_kv_xfer_finished()
    assert kv.num_free_blocks == 60 and "a" in sched.kv_transfers.finished_sending
    assert connector.end_send("a")  # the last reader is done
    sched.update_from_kv_xfer_finished()
    assert kv.num_free_blocks == 63 and not sched.kv_transfers.finished_sending
    kv.check_invariants()


@pytest.mark.parametrize("ask, eos, expect_held", [(True, None, True), (False, None, False),
                                                   (True, "first", False)])
def test_connector_frees_at_once_unless_asked_and_length_capped(ask, eos, expect_held):
    """No transfer asked, or a stop on the first token: freed when the request finishes."""
    sched = make_scheduler(kv_connector=KVConnector())
    req = make_request("a", 40, max_tokens=1)
    req.eos_token_id = model_token(req) if eos else None
    req.kv_transfer_params = RemoteDecode() if ask else None
    sched.add_request(req)
    step(sched, FakeRunner(sched))
    assert (sched.kv_cache_manager.num_free_blocks == 60) == expect_held
    assert (req.kv_transfer_params is not None) == expect_held


def test_default_role_frees_finished_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", 40, max_tokens=1))
    step(sched, FakeRunner(sched))
    assert sched.kv_cache_manager.get_block_ids("a") == []
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_admits_request_with_transferred_kv():
    """Decode role: blocks allocated and KV written before add_request."""
    sched = make_scheduler()
    kv = sched.kv_cache_manager
    req = make_request("a", 40, max_tokens=3)
    assert kv.allocate_slots(req, 40, delay_cache_blocks=True) is not None
    runner = FakeRunner(sched)
    ids = kv.get_block_ids("a")
    for pos in range(40):  # the "transfer" writes the prompt's KV
        runner.kv[ids[pos // BS] * BS + pos % BS] = (pos, req.token_at(pos))
    kv.cache_blocks(req, 40)
    req.num_computed_tokens = 40
    req.append_output_token(model_token(req))
    sched.add_request(req)
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 40, 1, True)]
    assert req.num_cached_tokens == 40
    run_all(sched, runner)
    assert req.num_output_tokens == 3 and kv.num_free_blocks == 63


def test_waiting_for_remote_kvs_gets_blocks_then_runs_once_received():
    """Decode role: the scheduler allocates a transfer's blocks in its admission order; the
    request waits (not stepping) until the connector reports the receive done."""
    connector = KVConnector()
    sched = make_scheduler(kv_connector=connector)
    kv = sched.kv_cache_manager
    req = make_request("a", 40, max_tokens=3)
    req.append_output_token(model_token(req))
    req.kv_transfer_params = RemotePrefill(num_tokens=40)
    allocated = []
    connector.expect_recv("a", lambda ids, hit: allocated.append((ids, hit)))
    sched.add_request(req)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.schedule().scheduled == [] and allocated == [([1, 2, 3], 0)]
    assert not sched.has_unfinished_requests() and sched.make_stats().num_waiting == 1
    runner = FakeRunner(sched)
    for pos in range(40):  # the "transfer" writes the prompt's KV
        runner.kv[pos // BS * BS + BS + pos % BS] = (pos, req.token_at(pos))
    connector.recv_finished("a", ok=True)
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 40, 1, True)] and req.num_cached_tokens == 40
    run_all(sched, runner)
    assert req.num_output_tokens == 3 and kv.num_free_blocks == 63


def test_a_receive_aborted_mid_write_keeps_its_blocks_until_it_ends():
    connector = KVConnector()
    sched = make_scheduler(kv_connector=connector)
    kv = sched.kv_cache_manager
    req = make_request("a", 40, max_tokens=3)
    req.append_output_token(1)
    req.kv_transfer_params = RemotePrefill(num_tokens=40)
    connector.expect_recv("a", lambda ids, hit: None)
    sched.add_request(req)
    sched.schedule()
    assert [r.request_id for r in sched.abort_requests(["a"])] == ["a"]
    assert kv.num_free_blocks == 60 and "a" in sched.kv_transfers.aborted_recving  # still written
    connector.recv_finished("a", ok=False)
    sched.update_from_kv_xfer_finished()
    assert kv.num_free_blocks == 63 and not sched.kv_transfers.aborted_recving
    kv.check_invariants()


# -- prefix caching -------------------------------------------------------------------------

def test_shared_prefix_is_reused():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=512, max_model_len=512)
    prefix = [(3 * i) % 97 + 1 for i in range(200)]
    a = make_request("a", prompt=prefix + [1, 2, 3], max_tokens=2)
    b = make_request("b", prompt=prefix + [4, 5], max_tokens=2)
    sched.add_request(a)
    runner = FakeRunner(sched)
    step(sched, runner)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 192
    s = next(s for s in out.scheduled if s.request is b)
    assert (s.start_pos, s.num_scheduled_tokens) == (192, 10)
    assert s.block_ids[:12] == list(range(1, 13))
    stats = sched.make_stats()
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries,
            stats.prefix_cache_hits) == (2, 203 + 202, 192)
    assert (stats.num_running, stats.num_waiting) == (1, 0)  # a finished
    run_all(sched, runner)


def test_same_step_admission_hits_blocks_cached_this_step():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=512, max_model_len=512)
    prefix = list(range(1, 201))
    a = make_request("a", prompt=prefix + [1], max_tokens=2)
    b = make_request("b", prompt=prefix + [2], max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, FakeRunner(sched))
    assert shape(out) == [("a", 0, 201, True), ("b", 192, 9, True)]
    assert b.num_cached_tokens == 192


def test_per_step_hashing_is_incremental(monkeypatch):
    calls = []
    real = prefix_hash_module.hash_block_tokens
    monkeypatch.setattr(prefix_hash_module, "hash_block_tokens",
                        lambda *a: calls.append(1) or real(*a))
    sched = make_scheduler(num_blocks=1200, max_num_seqs=128, max_num_batched_tokens=16384,
                           max_model_len=512)
    reqs = [make_request(f"r{i}", 100, max_tokens=33) for i in range(128)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    runner.execute = lambda out: runner_output({s.request.request_id: 7
                                                for s in out.scheduled if s.sample})
    run_all(sched, runner)
    assert all(r.num_tokens == 133 for r in reqs)
    # Each full block is hashed once: 6 prompt blocks + 2 filled while decoding (132 KV
    # tokens), not once per step.
    assert len(calls) == 128 * 8
