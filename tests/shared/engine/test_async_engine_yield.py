"""AsyncEngine and the core share: an engine told to wait (0 threads) does not step, does
not count as stalled, and steps once it gets cores again (a fake EngineCore)."""

from __future__ import annotations

import threading
import time

from shared.engine.async_engine import AsyncEngine


class _FakeCore:
    def __init__(self, waits: int) -> None:
        self.waits = waits
        self.acquires = 0
        self.steps = 0
        self.stepping_thread: str | None = None
        self.done = threading.Event()

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
