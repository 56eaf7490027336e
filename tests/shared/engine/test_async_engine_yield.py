"""AsyncEngine's stepping loop (fake EngineCores): an engine told to wait by the core share
(0 threads) does not step, does not count as stalled, and steps once it gets cores again;
an idle engine takes a whole burst of arrivals before its first step, for at most ten
burst gaps."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from pdserve.shared.engine.async_engine import AsyncEngine


class _FakeCore:
    last_step_scheduled = True  # AsyncEngine reads it after each step
    trace_file = ""  # no timeline

    def __init__(self, waits: int) -> None:
        self.waits = waits
        self.acquires = 0
        self.steps = 0
        self.stepping_thread: str | None = None
        self.done = threading.Event()
        self.scheduler = SimpleNamespace(scheduler_config=SimpleNamespace(burst_gap_s=0.0))

    def bind_stepping_thread(self) -> None:
        self.stepping_thread = threading.current_thread().name

    def has_unfinished_requests(self) -> bool:
        return self.steps < 3

    def mark_idle(self) -> None:
        self.done.set()

    def acquire_cores(self) -> int:
        self.acquires += 1
        return 0 if self.acquires <= self.waits else 2

    def step(self) -> list:
        assert self.acquires > self.waits, "stepped while told to wait"
        self.steps += 1
        return []

    def shutdown(self) -> None:
        pass


def test_waits_while_told_to_then_steps_and_never_looks_stalled():
    core = _FakeCore(waits=20)
    engine = AsyncEngine(core, name="yield-test")  # type: ignore[arg-type]
    try:
        assert core.done.wait(10)
        assert core.steps == 3 and core.acquires == 20 + 3
        assert core.stepping_thread == "yield-test"
        # Waiting for cores refreshed the progress clock: nothing here looks stalled.
        assert time.monotonic() - engine.last_step_time < 5.0
    finally:
        engine.shutdown()


class _CountingCore:
    """Counts the requests added before its first step; steps until `target` are done."""
    last_step_scheduled = True  # AsyncEngine reads it after each step
    trace_file = ""  # no timeline

    def __init__(self, burst_gap_s: float, target: int) -> None:
        self.scheduler = SimpleNamespace(
            scheduler_config=SimpleNamespace(burst_gap_s=burst_gap_s))
        self.added = 0
        self.target = target
        self.seen_at_first_step: int | None = None
        self.finished = 0

    def bind_stepping_thread(self) -> None:
        pass

    def add(self) -> None:
        self.added += 1

    def has_unfinished_requests(self) -> bool:
        return self.finished < self.added

    def mark_idle(self) -> None:
        pass

    def acquire_cores(self) -> int:
        return 2

    def step(self) -> list:
        if self.seen_at_first_step is None:
            self.seen_at_first_step = self.added
        self.finished = self.added
        return []

    def shutdown(self) -> None:
        pass


async def _arrive(engine: AsyncEngine, n: int, spacing_s: float) -> None:
    for _ in range(n):
        await engine.call(lambda e: e.add())
        await asyncio.sleep(spacing_s)


def test_an_idle_engine_takes_a_whole_burst_before_its_first_step():
    # Arrivals 5 ms apart, a 200 ms gap: all ten are in the first step's view.
    core = _CountingCore(burst_gap_s=0.2, target=10)
    engine = AsyncEngine(core, name="burst-test")  # type: ignore[arg-type]
    try:
        asyncio.run(_arrive(engine, 10, 0.005))
        deadline = time.monotonic() + 10
        while core.seen_at_first_step is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.seen_at_first_step == 10
    finally:
        engine.shutdown()


def test_the_burst_wait_is_capped_at_ten_gaps():
    # Arrivals keep coming every 10 ms for about 1.5 s; with a 20 ms gap the engine must
    # step by about 200 ms, long before the last arrival.
    core = _CountingCore(burst_gap_s=0.02, target=150)
    engine = AsyncEngine(core, name="burst-cap-test")  # type: ignore[arg-type]
    try:
        asyncio.run(_arrive(engine, 150, 0.01))
        assert core.seen_at_first_step is not None
        assert 1 <= core.seen_at_first_step < 150
    finally:
        engine.shutdown()


class _BlockedCore(_CountingCore):
    """Has work that cannot be scheduled (as transfers waiting for blocks that receives in
    flight hold): every step schedules nothing."""

    last_step_scheduled = False

    def step(self) -> list:
        self.steps = getattr(self, "steps", 0) + 1
        return []


def test_an_engine_whose_step_schedules_nothing_waits_for_an_op_instead_of_spinning():
    core = _BlockedCore(burst_gap_s=0.0, target=1)
    engine = AsyncEngine(core, name="blocked-test")  # type: ignore[arg-type]
    try:
        asyncio.run(_arrive(engine, 1, 0.3))  # one request; then 0.3 s with nothing new
        # A wait of _YIELD_WAIT_S (5 ms) per empty step: about 60 steps in 0.3 s; a spinning
        # loop makes tens of thousands.
        assert 1 <= core.steps <= 300, core.steps
    finally:
        engine.shutdown()
