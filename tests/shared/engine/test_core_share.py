"""CoreShare: engines of one host split its cores among those busy now (real processes:
record locks are per process, so each engine here is its own process)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from pdserve.shared.engine.core_share import NO_PREFILL, CoreShare

_ctx = mp.get_context("fork")


def _engine(path: str, num_cores: int, busy: bool, ready, stop, urgency=NO_PREFILL,
            can_yield=False, poll=False) -> None:
    share = CoreShare(path, num_cores, linger_s=0.0)
    share.update(busy=busy, urgency=urgency, can_yield=can_yield)
    ready.set()
    # poll: ask again every 2 ms, as an engine between steps (or waiting) does.
    while not stop.wait(0.002 if poll else 30):
        share.update(busy=busy, urgency=urgency, can_yield=can_yield)
    share.close()


def _start(path: str, num_cores: int = 2, busy: bool = True, urgency=NO_PREFILL,
           can_yield=False, poll=False):
    ready, stop = _ctx.Event(), _ctx.Event()
    proc = _ctx.Process(target=_engine, args=(path, num_cores, busy, ready, stop, urgency,
                                              can_yield, poll), daemon=True)
    proc.start()
    assert ready.wait(30)
    return proc, stop


def _stop(proc, stop) -> None:
    stop.set()
    proc.join(10)


@pytest.fixture
def board(tmp_path):
    return str(tmp_path / "board")


def test_alone_takes_every_core(board):
    share = CoreShare(board, 2)
    try:
        assert share.update(busy=True) == 2
        assert share.busy_engines() == 1
        assert share.update(busy=False) == 2
        assert share.busy_engines() == 0
    finally:
        share.close()


def test_two_busy_engines_split_the_cores_and_get_them_back(board):
    other, stop = _start(board, busy=True)
    share = CoreShare(board, 2, linger_s=0.0)
    try:
        assert share.slot == 1  # the other engine holds slot 0
        assert share.update(busy=True) == 1
        assert share.busy_engines() == 2
        _stop(other, stop)  # it closes its slot
        assert share.update(busy=True) == 2
    finally:
        share.close()


def test_idle_engine_leaves_its_cores(board):
    other, stop = _start(board, busy=False)
    share = CoreShare(board, 2, linger_s=0.0)
    try:
        assert share.update(busy=True) == 2
        assert share.busy_engines() == 1
    finally:
        share.close()
        _stop(other, stop)


def test_remainder_goes_to_the_lower_slots(board):
    other, stop = _start(board, num_cores=3, busy=True)
    share = CoreShare(board, 3, linger_s=0.0)
    try:
        assert share.update(busy=True) == 1  # slot 1 of 2 busy: 3 = 2 + 1
    finally:
        share.close()
        _stop(other, stop)


def test_a_dead_engine_holds_no_cores(board):
    other, _ = _start(board, busy=True)
    os.kill(other.pid, signal.SIGKILL)  # no close(): its slot still reads busy
    other.join(10)
    share = CoreShare(board, 2, linger_s=0.0)
    try:
        # The dead engine's slot is free again (the kernel dropped its lock): claimed here.
        assert share.slot == 0
        assert share.update(busy=True) == 2
    finally:
        share.close()


def test_a_dead_engine_in_another_slot_is_cleared(board):
    first, first_stop = _start(board, busy=True)
    second, _ = _start(board, busy=True)  # slot 1
    share = CoreShare(board, 2, linger_s=0.0)
    try:
        assert share.slot == 2
        assert share.update(busy=True) == 1  # three busy on two cores: at least 1
        os.kill(second.pid, signal.SIGKILL)
        second.join(10)
        assert share.busy_engines() == 2
        assert share.update(busy=True) == 1
        _stop(first, first_stop)
        assert share.update(busy=True) == 2
    finally:
        share.close()


def test_linger_keeps_a_just_idle_engine_counted(board):
    other, stop = _start(board, busy=True)
    try:
        lingering = CoreShare(board, 2, linger_s=60.0)
        # The other engine (slot 0) goes idle just now: a reader with a long linger still
        # counts it, one with none does not.
        lingering._write(0, -time.monotonic_ns(), NO_PREFILL)
        assert lingering.update(busy=True) == 1
        lingering.linger_ns = 0
        assert lingering.update(busy=True) == 2
        lingering.close()
    finally:
        _stop(other, stop)


def test_rejects_zero_cores(board):
    with pytest.raises(ValueError, match="num_cores"):
        CoreShare(board, 0)


def test_thread_count_is_applied_by_the_engine_step(board, monkeypatch):
    """EngineCore.acquire_cores sizes torch's pool from the board (a fake scheduler)."""
    import torch

    class _Share:
        def __init__(self):
            self.calls = []

        def update(self, busy, urgency=NO_PREFILL, can_yield=False):
            self.calls.append(busy)
            return 1

    class _Scheduler:
        def schedule(self, max_prefill_tokens=None):
            class _Out:
                scheduled = []
            return _Out()

        def prefill_urgency(self):
            return 7, False

    core = _bare_core(_Share(), _Scheduler())
    core.drafter = None  # no speculative decoding
    before = torch.get_num_threads()
    try:
        assert core.acquire_cores() == 1
        assert core.step() == []
        assert torch.get_num_threads() == 1
        core.mark_idle()
        assert core.core_share.calls == [True, False]
    finally:
        torch.set_num_threads(before)


def test_a_prefill_engine_yields_to_a_shorter_prefill_elsewhere(board):
    """Shortest prefill first across the host: a pure-prefill engine (can_yield) whose next
    prompt is longer than a busy engine's waits with 0 threads; the other gets every core."""
    decode, stop = _start(board, busy=True, urgency=40, can_yield=False)
    share = CoreShare(board, 2, linger_s=0.0)
    try:
        assert share.update(busy=True, urgency=300, can_yield=True) == 0
        # Not shorter: ties and longer prefills elsewhere do not make it wait.
        assert share.update(busy=True, urgency=40, can_yield=True) == 1
        assert share.update(busy=True, urgency=10, can_yield=True) == 1
        # An engine with decodes running never waits (it would stall its streams).
        assert share.update(busy=True, urgency=300, can_yield=False) == 1
    finally:
        _stop(decode, stop)
    assert share.update(busy=True, urgency=300, can_yield=True) == 2
    share.close()


def _threads_within(share: CoreShare, seconds: float = 10.0, **kw) -> list[int]:
    """Ask every 2 ms until the answer is non-zero (or time is up); all answers."""
    answers = [share.update(busy=True, **kw)]
    deadline = time.monotonic() + seconds
    while answers[-1] == 0 and time.monotonic() < deadline:
        time.sleep(0.002)
        answers.append(share.update(busy=True, **kw))
    return answers


def test_the_shorter_engine_takes_the_yielding_engines_cores_once_it_parks(board):
    # The prefill engine published 300 and runs its step; it has not seen the shorter
    # prefill yet, so taking its cores now would put 4 threads on 2 cores: wait.
    prefill, stop = _start(board, busy=True, urgency=300, can_yield=True)
    share = CoreShare(board, 2, linger_s=0.0)
    try:
        assert share.update(busy=True, urgency=40, can_yield=True) == 0
        # With streams running (no yield) it never waits for that step to end: it takes
        # its share beside it (1), and every core once the other engine has parked.
        assert share.update(busy=True, urgency=40, can_yield=False) == 1
    finally:
        _stop(prefill, stop)
        share.close()
    # An engine that asks again between steps parks, and then its cores are free.
    prefill, stop = _start(board, busy=True, urgency=300, can_yield=True, poll=True)
    share = CoreShare(board, 2, linger_s=0.0)
    try:
        assert _threads_within(share, urgency=40, can_yield=True)[-1] == 2
        # Only decodes left here (no prefill, no yield): the prefill engine no longer
        # yields, the cores are split.
        assert _threads_within(share, urgency=NO_PREFILL, can_yield=False)[-1] == 1
    finally:
        _stop(prefill, stop)
        share.close()


def test_a_decode_only_engine_yields_to_a_prefill_until_its_stall_bound(board):
    """Prefill before decode: an engine with only decodes (NO_PREFILL, can_yield) waits while
    a prefill engine is busy, and the prefill engine gets every core; when the decodes are
    due (urgency 0, no yield) the prefill engine parks at its next step boundary and the
    decode engine gets every core."""
    prefill, stop = _start(board, busy=True, urgency=300, can_yield=True, poll=True)
    share = CoreShare(board, 2, linger_s=0.0)
    try:
        assert share.update(busy=True, urgency=NO_PREFILL, can_yield=True) == 0
        # Parked: the prefill engine (slot 0) counts this one out.
        assert share._read(share.slot)[1] & (1 << 61)
        # Due: it takes its share at once, beside the prefill engine's step in flight, and
        # every core once that engine has parked (at its next step boundary).
        # (2 when the prefill engine parked between this engine's write and its read)
        assert share.update(busy=True, urgency=0, can_yield=False) in (1, 2)
        deadline = time.monotonic() + 10
        while share.update(busy=True, urgency=0, can_yield=False) != 2:
            assert time.monotonic() < deadline, "the prefill engine never parked"
            time.sleep(0.002)
        # Not due again: it yields again (and the prefill engine takes the cores back).
        assert share.update(busy=True, urgency=NO_PREFILL, can_yield=True) == 0
    finally:
        _stop(prefill, stop)
        share.close()
    # Alone, a decode-only engine that may yield runs on every core.
    share = CoreShare(board, 2, linger_s=0.0)
    try:
        assert share.update(busy=True, urgency=NO_PREFILL, can_yield=True) == 2
    finally:
        share.close()


def test_engine_core_yields_its_decodes_until_the_stall_bound():
    """EngineCore.acquire_cores: only decodes and a recent step -> may yield (NO_PREFILL,
    can_yield); past max_decode_stall_s -> urgency 0, no yield; a local prefill or a bound
    of 0 -> never yields."""

    class _Share:
        def __init__(self):
            self.calls = []

        def update(self, busy, urgency=NO_PREFILL, can_yield=False):
            self.calls.append((urgency, can_yield))
            return 2

    class _Scheduler:
        answer = (NO_PREFILL, True)

        def prefill_urgency(self):
            return self.answer

    core = _bare_core(_Share(), _Scheduler())
    core.max_decode_stall_ns = int(0.5e9)
    core._last_step_end_ns = time.monotonic_ns()
    core.acquire_cores()
    core._last_step_end_ns = time.monotonic_ns() - int(0.6e9)
    core.acquire_cores()
    core.scheduler.answer = (40, True)  # a local prefill besides the decodes
    core.acquire_cores()
    core.scheduler.answer = (NO_PREFILL, True)
    core.max_decode_stall_ns = 0
    core.acquire_cores()
    assert core.core_share.calls == [(NO_PREFILL, True), (0, False), (40, False),
                                     (NO_PREFILL, False)]


def _bare_core(share, scheduler, max_yield_s: float = 0.5):
    """An EngineCore with only what acquire_cores reads (no model)."""
    from pdserve.shared.engine import engine_core

    core = engine_core.EngineCore.__new__(engine_core.EngineCore)
    core.core_share, core.scheduler = share, scheduler
    core.max_decode_stall_ns = 0
    core.max_yield_ns = int(max_yield_s * 1e9)
    core.slo_tpot_s = core.tpot_reserve_s = 0.0
    core._yielding_since_ns = 0
    core._last_step_end_ns = 0
    core.prefill_budget = None
    return core


class _Queues:
    def __init__(self, answer, slack=float("inf")):
        self.answer, self.slack = answer, slack

    def prefill_urgency(self):
        return self.answer

    def min_tpot_slack(self, slo_tpot_s):
        return self.slack


class _ParkingShare:
    """Parks (0 threads) whenever the engine may yield, as a board with a shorter prefill
    elsewhere would, forever."""

    def __init__(self):
        self.calls = []

    def update(self, busy, urgency=NO_PREFILL, can_yield=False):
        self.calls.append((urgency, can_yield))
        return 0 if can_yield else 1


def test_an_engine_with_only_kv_admissions_never_yields():
    """No decodes, no prefill (requests waiting for their KV to arrive): the step that books
    them costs nothing, so the engine never waits for another's prefill (it did: a lone
    request then waited forever while another stack of the host had work)."""
    share = _ParkingShare()
    core = _bare_core(share, _Queues((NO_PREFILL, False)))
    assert core.acquire_cores() == 1
    assert share.calls == [(NO_PREFILL, False)]


def test_no_engine_yields_past_its_bound():
    """A prefill engine that always finds a shorter prefill elsewhere waits at most
    max_yield_s, then publishes itself overdue (urgency 0, no yield) and takes a step."""
    share = _ParkingShare()
    core = _bare_core(share, _Queues((300, False)), max_yield_s=0.05)
    started = time.monotonic()
    while core.acquire_cores() == 0:
        assert time.monotonic() - started < 5, "waited past its bound"
        time.sleep(0.002)
    waited = time.monotonic() - started
    assert 0.05 <= waited < 2.0
    assert share.calls[0] == (300, True) and share.calls[-1] == (0, False)
    # After its step it may yield again (the bound restarts).
    assert core.acquire_cores() == 0 and share.calls[-1] == (300, True)


def test_decodes_yield_while_their_streams_have_tpot_slack():
    """With a TPOT target, a decode-only engine lets the prefill engine have the cores
    (NO_PREFILL, can_yield) while its streams keep more slack than the reserve; below it
    the engines split the cores."""
    share = _ParkingShare()
    queues = _Queues((NO_PREFILL, True), slack=0.5)
    core = _bare_core(share, queues)
    core.slo_tpot_s, core.tpot_reserve_s = 0.1, 0.2
    assert core.acquire_cores() == 0 and share.calls[-1] == (NO_PREFILL, True)
    queues.slack = 0.15  # below the reserve: no yield, the cores are split
    assert core.acquire_cores() == 1 and share.calls[-1] == (NO_PREFILL, False)
    queues.answer = (40, True)  # a local prefill as well: it never yields
    assert core.acquire_cores() == 1 and share.calls[-1] == (40, False)


def test_min_tpot_slack():
    from pdserve.shared.engine.scheduling_policy import min_tpot_slack
    from pdserve.shared.request import Request
    from pdserve.shared.sampling_params import SamplingParams

    def stream(arrived: float, num_output: int, prefilled: bool = True) -> Request:
        r = Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=64))
        r.arrival_time = arrived
        r.output_token_ids.extend([5] * num_output)
        r.num_computed_tokens = 4 if prefilled else 2
        return r

    # 1.0 s ago with 11 tokens: budget 0.1 * 10 = 1.0 s, used 1.0 -> 0; 0.5 s ago with 11
    # tokens: 0.5 left; one still in its prompt does not count.
    now = 100.0
    assert min_tpot_slack([], 0.1, now) == float("inf")
    assert min_tpot_slack([stream(99.5, 11)], 0.1, now) == pytest.approx(0.5)
    assert min_tpot_slack([stream(99.5, 11), stream(99.0, 11), stream(90.0, 1, False)],
                          0.1, now) == pytest.approx(0.0)


def test_scheduler_prefill_urgency():
    import time as _time

    from pdserve.shared.config import SchedulerConfig
    from pdserve.shared.engine.scheduler import Scheduler
    from pdserve.shared.engine.scheduling_policy import prefill_urgency
    from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
    from pdserve.shared.request import Request
    from pdserve.shared.sampling_params import SamplingParams
    from tests.shared.engine.test_scheduler import runner_output

    kv = KVCacheManager(64, 16, enable_caching=False, model_name="m")
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=40, max_wait_s=5.0), kv)
    assert scheduler.prefill_urgency() == (NO_PREFILL, False)
    scheduler.add_request(Request("a", list(range(1, 31)), SamplingParams(max_tokens=4)))
    scheduler.add_request(Request("b", list(range(1, 101)), SamplingParams(max_tokens=4)))
    assert scheduler.prefill_urgency() == (30, False)
    out = scheduler.schedule()  # a whole (30), b's first 10 tokens
    scheduler.update_from_output(out, runner_output({s.request.request_id: 5
                                       for s in out.scheduled if s.sample}))
    assert scheduler.prefill_urgency() == (90, True)  # a decodes, b has 90 prompt tokens left
    # A stream whose prompt KV arrived (one token left, an output token): a decode.
    arrived = Request("arrived", list(range(1, 61)), SamplingParams(max_tokens=4))
    arrived.output_token_ids.append(7)
    arrived.num_computed_tokens = 60
    assert prefill_urgency([arrived], [], SchedulerConfig()) == (NO_PREFILL, True)
    late = Request("late", list(range(1, 201)), SamplingParams(max_tokens=4))
    late.arrival_time = _time.monotonic() - 6.0
    scheduler.add_request(late)
    assert scheduler.prefill_urgency() == (0, True)  # overdue: most urgent
