"""StepGate: a test-only engine step fault hook that holds the engine thread mid-run."""

from __future__ import annotations

import threading


class StepGate:
    """Holds the engine thread before its step number `hold_at` (0-based), until released."""

    def __init__(self, hold_at: int) -> None:
        self.hold_at = hold_at
        self.num_calls = 0
        self.entered = threading.Event()
        self.released = threading.Event()

    def __call__(self) -> None:
        self.num_calls += 1
        if self.num_calls == self.hold_at + 1:
            self.entered.set()
            assert self.released.wait(120), "the test never released the step"
