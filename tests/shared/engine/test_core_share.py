"""CoreShare: engines of one host split its cores among those busy now (real processes:
record locks are per process, so each engine here is its own process)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from shared.engine.core_share import CoreShare

_ctx = mp.get_context("fork")


def _engine(path: str, num_cores: int, busy: bool, ready, stop) -> None:
    share = CoreShare(path, num_cores, linger_s=0.0)
    share.update(busy=busy)
    ready.set()
    stop.wait(30)
    share.close()


def _start(path: str, num_cores: int = 2, busy: bool = True):
    ready, stop = _ctx.Event(), _ctx.Event()
    proc = _ctx.Process(target=_engine, args=(path, num_cores, busy, ready, stop), daemon=True)
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
        lingering._write(0, -time.monotonic_ns())
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
    """EngineCore.step sizes torch's pool from the board (a fake model runner)."""
    import torch

    from shared.engine import engine_core

    class _Share:
        def __init__(self):
            self.calls = []

        def update(self, busy):
            self.calls.append(busy)
            return 1

    core = engine_core.EngineCore.__new__(engine_core.EngineCore)
    core.core_share = _Share()

    class _Scheduler:
        def schedule(self):
            class _Out:
                scheduled = []
            return _Out()

    core.scheduler = _Scheduler()
    before = torch.get_num_threads()
    try:
        assert core.step() == []
        assert torch.get_num_threads() == 1
        core.mark_idle()
        assert core.core_share.calls == [True, False]
    finally:
        torch.set_num_threads(before)
