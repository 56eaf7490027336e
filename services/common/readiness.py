"""Readiness apart from liveness: a watchdog that turns health NOT_SERVING while the engine's
step loop is stalled with work queued, and back to SERVING when it makes progress again.

    liveness:   the gRPC server answers (grpc.health Check answers at all)
    readiness:  Check says SERVING: loaded, not draining, and not stalled, where
                stalled = work queued (running / waiting requests or pending engine ops)
                          and no completed step for longer than `stall_timeout` seconds

The watchdog reads two fields the engine thread writes (AsyncEngine.last_step_time and the
scheduler's queues) without calling into the engine thread, so a stuck thread cannot hang it.
Detection latency: at most stall_timeout + stall_check_interval.

A step that is running counts as work, not as a stall, for up to IN_STEP_FACTOR x
stall_timeout: one chunked-prefill step over a long context can legitimately take tens of
seconds on a loaded CPU (an 8k-token prompt's last 2048-token chunk took 27.8 s on 2 cores),
while the loop not even starting a step with work queued is what a stall looks like. A step
hung inside the kernels is still caught, later.

Failing steps: a step that raises fails its requests over (shared/engine/async_engine.py);
after FAILING_STEPS_NOT_SERVING steps in a row raised, health turns NOT_SERVING too (the
gateway stops placing requests here), and back to SERVING after a step that does not raise.

Test hooks, off by default: `stall_file_hook` (ServiceConfig.test_stall_file) stalls the
loop and `step_fault_hook` (env PDSERVE_TEST_STEP_FAULT_FILE) fails its steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from pdserve.shared.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

_STALL_POLL_S = 0.02
IN_STEP_FACTOR = 4.0
"""A step in progress is a stall only after this many stall_timeouts."""
FAILING_STEPS_NOT_SERVING = 3
"""Steps in a row that raised before health turns NOT_SERVING."""
STEP_FAULT_ENV = "PDSERVE_TEST_STEP_FAULT_FILE"


class StallWatchdog:
    """Calls `on_change(stalled, seconds)` when the engine enters or leaves a stall.

    Args:
        engine: the instance's engine (its thread is the one watched).
        stall_timeout: seconds without progress, with work queued, that count as a stall.
        interval: seconds between looks.
        on_change: awaited with (True, seconds since progress) when a stall starts and
            (False, stall duration) when it ends.
    """

    def __init__(self, engine: AsyncEngine, stall_timeout: float, interval: float,
                 on_change: Callable[[bool, float], Awaitable[None]]) -> None:
        self.engine = engine
        self.stall_timeout = stall_timeout
        self.interval = interval
        self.on_change = on_change
        self.stalled = False
        self._stalled_since = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def check(self) -> bool:
        """One look; returns whether the engine is stalled (or its steps keep failing)."""
        idle_for = self.engine.seconds_since_progress()
        in_step = self.engine.seconds_in_step() > 0.0
        bound = self.stall_timeout * (IN_STEP_FACTOR if in_step else 1.0) \
            if self.stall_timeout > 0 else float("inf")
        failures = self.engine.consecutive_step_failures
        failing = failures >= FAILING_STEPS_NOT_SERVING
        if not self.stalled and (idle_for > bound or failing):
            self.stalled, self._stalled_since = True, time.monotonic() - idle_for
            if failing:
                logger.error("engine steps keep failing (%d in a row); health NOT_SERVING",
                             failures)
            else:
                logger.error("engine stalled: no step completed for %.1f s with work "
                             "queued (--stall-timeout %g); health NOT_SERVING", idle_for,
                             self.stall_timeout)
            await self.on_change(True, idle_for)
        elif self.stalled and idle_for <= bound and not failing:
            self.stalled = False
            duration = time.monotonic() - self._stalled_since
            logger.warning("engine progressing again after a %.1f s stall; health SERVING",
                           duration)
            await self.on_change(False, duration)
        return self.stalled

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # never let the watchdog take the service down
                logger.exception("stall watchdog check failed")
            await asyncio.sleep(self.interval)


def step_fault_hook(path: str) -> Callable[[], None]:
    """The test hook: while `path` exists, raise RuntimeError (engine thread, before each
    step runs the model)."""
    def hook() -> None:
        if os.path.exists(path):
            raise RuntimeError(f"injected step fault ({STEP_FAULT_ENV}={path})")
    return hook


def stall_file_hook(engine: AsyncEngine, path: str) -> Callable[[], None]:
    """The test hook: while `path` exists and the engine has requests, sleep (engine thread,
    before each step): the loop stalls without anything else changing."""
    def hook() -> None:
        # NOTE: stopped: a shutdown must not wait for the file to go away.
        while os.path.exists(path) and engine.engine_core.has_unfinished_requests() \
                and not engine.stopped:
            time.sleep(_STALL_POLL_S)
    return hook
