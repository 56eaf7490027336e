"""AsyncEngine: an EngineCore stepped in its own thread, driven from asyncio.

The engine thread owns the EngineCore: every mutation (add, abort, KV admission) runs
there, between steps, as an op submitted with `call`. Outputs go back to per-request
asyncio queues with `loop.call_soon_threadsafe`, so the gRPC servers' event loops never
block on a model step (which holds the GIL only between torch kernels).

    grpc handler ──call(fn)──▶ op queue ──▶ engine thread: ops; step(); dispatch deltas
         ▲                                                        │
         └──────────── asyncio.Queue per request ◀────────────────┘

An abort never waits for a step: `request_abort` marks the request (`aborting`, read by the
engine thread) and queues its abort op, which runs before the next step is scheduled, so the
request's uncomputed prompt chunks are never scheduled; only the step in flight when the
abort arrived still computes its chunk (counted in `EngineCore.num_prompt_tokens_after_abort`).

A step that raises (a bad kernel input, out of memory, a bug) fails every request the engine
holds: their blocks are freed and their streams raise EngineStepError, which the services
answer INTERNAL, a status the gateway fails over (with the tokens so far). The engine goes
on serving; `consecutive_step_failures` tells the readiness watchdog when it keeps failing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from pdserve.shared.engine.engine_core import EngineCore
from pdserve.shared.engine.scheduler_output import EngineCoreOutput
from pdserve.shared.engine.trace import Tracer, now_us
from pdserve.shared.request import FinishReason, Request

logger = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.05
_YIELD_WAIT_S = 0.005


class EngineStepError(RuntimeError):
    """The engine step that ran this request raised; the request was failed (blocks freed)
    and another instance may continue it from the tokens it already produced."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


class AsyncEngine:
    def __init__(self, engine_core: EngineCore, name: str = "engine") -> None:
        self.engine_core = engine_core
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.aborting: dict[str, None] = {}
        """Ids of open streams whose abort has arrived, until their stream ends. Written on the
        event loop's thread; the engine thread only tests membership (atomic under the GIL):
        an add op skips such a request, and the core counts the prompt tokens a step computed
        for them."""
        engine_core.aborts_arrived = self.aborting
        self.last_step_time = time.monotonic()
        """Monotonic time the loop last made progress (a step, or idle with no work)."""
        self.num_steps = 0
        self.step_started: float | None = None
        """Monotonic start of the step running now (None between steps)."""
        self.stall_hook: Callable[[], None] | None = None
        """Test hook: called each loop iteration (e.g. to make the loop stall)."""
        self.fault_hook: Callable[[], None] | None = None
        """Test hook: called just before each step; what it raises fails the step."""
        self.consecutive_step_failures = 0
        """Steps in a row that raised (0 after a step that did not)."""
        self.tracer = (Tracer(engine_core.trace_file, f"{name} (pid {os.getpid()})")
                       if engine_core.trace_file else None)
        """The opt-in timeline (`--trace-file`); the services add their KV transfers."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- asyncio side ---------------------------------------------------------------------

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(engine_core)` on the engine thread between steps; return or raise its result."""
        return await self.submit(fn)

    def submit(self, fn: Callable[[EngineCore], T]) -> asyncio.Future:
        """Queue `fn(engine_core)` for the engine thread now (ops run in submission order, between
        steps); the future of its result. Call it on the event loop's thread."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._ops.put((fn, loop, fut))
        self._wake.set()
        return fut

    async def generate(self, request: Request,
                       validated: bool = False) -> AsyncIterator[EngineCoreOutput]:
        """Add `request` and yield its deltas until it finishes (`validated`: the caller ran
        `EngineCore.validate_request` on it already, see `EngineCore.add_request`).

        Raises ValueError (bad input) before yielding anything, EngineStepError when a step
        that ran it failed (the request is gone from the engine). If the consumer stops
        early (cancelled, closed), the request is aborted and its blocks freed.
        """
        request_id = request.request_id
        q: asyncio.Queue = asyncio.Queue()
        # NOTE: the stream exists before the add op is queued, so an abort that arrives
        # meanwhile (e.g. during a grammar compile) is marked and the add op skips it.
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        submitted = finished = False
        try:
            structured_outputs = request.sampling_params.structured_outputs
            if structured_outputs is not None:  # compiled off the engine thread, cached
                await self.engine_core.structured_output.wait_for_grammar(structured_outputs)
            submitted = True
            try:
                await self.call(lambda e: self._add_op(request, validated))
            except Exception:
                submitted = False  # refused: nothing was added
                raise
            while not finished:
                delta: EngineCoreOutput | EngineStepError = await q.get()
                if isinstance(delta, EngineStepError):
                    finished = True  # the engine already dropped the request
                    raise delta
                finished = delta.finished
                yield delta
        finally:
            aborting = submitted and not finished
            if aborting:  # marked while its stream is still known (counts its step in flight)
                self._mark_aborting([request_id])
            self._streams.pop(request_id, None)
            try:
                if aborting:
                    await asyncio.shield(self.abort([request_id]))
            finally:
                self.aborting.pop(request_id, None)

    async def abort(self, request_ids: list[str]) -> list[str]:
        """`request_abort`, then wait for the engine thread to apply it (at most the step in
        flight); returns the ids it aborted (those still in the scheduler)."""
        self._mark_aborting(request_ids)
        return await self.call(lambda e: self._abort_op(request_ids))

    async def set_paused(self, request_ids: list[str], paused: bool) -> list[str]:
        """Pause (or resume) the given requests between steps (`Scheduler.pause_requests`).

        Returns the ids the engine holds, unfinished: each is now in the state asked for.
        Unknown, finished or aborted ids are ignored (a pause racing a finish is a no-op).
        """
        def op(e: EngineCore) -> list[str]:
            scheduler = e.scheduler
            known = [r for r in request_ids if r in scheduler.requests]
            (scheduler.pause_requests if paused else scheduler.resume_requests)(known)
            return known
        return await self.call(op)

    def request_abort(self, request_ids: list[str]) -> list[str]:
        """Abort without waiting for the engine thread (control calls must not queue behind
        a model step): the abort op runs before the next step is scheduled, frees the
        blocks and ends the open streams with an ABORT delta. Call it on the event loop's
        thread. Returns the ids with an open stream here."""
        known = self._mark_aborting(request_ids)
        self._ops.put((lambda e: self._abort_op(request_ids), None, None))
        self._wake.set()
        return known

    def _mark_aborting(self, request_ids: list[str]) -> list[str]:
        known = [r for r in request_ids if r in self._streams]
        for request_id in known:
            self.aborting[request_id] = None
        return known

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.engine_core.shutdown()
        if self.tracer is not None:
            self.tracer.close()

    def seconds_since_progress(self) -> float:
        """0 while idle; else seconds since the last completed step (readiness probes)."""
        if not self.engine_core.has_unfinished_requests() and self._ops.empty():
            return 0.0
        return time.monotonic() - self.last_step_time

    @property
    def stopped(self) -> bool:
        """Whether `shutdown()` began (a hook on the engine thread must stop waiting)."""
        return self._stopped

    def seconds_in_step(self) -> float:
        """Seconds the step running now has taken so far; 0 between steps."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    # -- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        self.engine_core.bind_stepping_thread()
        burst_gap_s = self.engine_core.scheduler.scheduler_config.burst_gap_s
        idle = True
        parked_since_us = 0  # timeline: when this engine began waiting on the core share
        while not self._stopped:
            if self.stall_hook is not None:
                self.stall_hook()
            self._run_ops()
            if not self.engine_core.has_unfinished_requests():
                self.engine_core.mark_idle()
                self.last_step_time = time.monotonic()
                idle = True
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            if idle and burst_gap_s > 0:
                self._gather_burst(burst_gap_s)
            idle = False
            threads = self.engine_core.acquire_cores()
            if threads == 0:
                # Another engine of this host has a shorter prefill: let it have the cores.
                # Waiting by choice is progress, not a stall (readiness watchdog).
                self.last_step_time = time.monotonic()
                parked_since_us = parked_since_us or now_us()
                self._wake.wait(_YIELD_WAIT_S)
                self._wake.clear()
                continue
            if self.tracer is not None and parked_since_us:
                self.tracer.complete("wait_cores", "engine", parked_since_us, now_us())
            parked_since_us = 0
            self.step_started = time.monotonic()
            step_started_us = now_us()
            try:
                if self.fault_hook is not None:
                    self.fault_hook()
                deltas = self.engine_core.step()
            except Exception as e:  # not bad input: fail the requests over, keep serving
                self.consecutive_step_failures += 1
                logger.exception("engine step failed (%d in a row); failing its requests",
                                 self.consecutive_step_failures)
                self._fail_all(e)
                continue
            finally:
                self.step_started = None
            self.consecutive_step_failures = 0
            self.num_steps += 1
            if self.tracer is not None and self.engine_core.last_step_scheduled:
                self._trace_step(step_started_us, threads)
            self.last_step_time = time.monotonic()
            self._dispatch(deltas)
            if not self.engine_core.last_step_scheduled:
                # Nothing could run (e.g. transfers waiting for blocks that receives in
                # flight hold): wait for an op (a receive finishing) instead of spinning.
                self._wake.wait(_YIELD_WAIT_S)
                self._wake.clear()

    def _trace_step(self, start_us: int, threads: int) -> None:
        output = self.engine_core.last_scheduler_output
        assert self.tracer is not None and output is not None
        num_decode = sum(1 for s in output.scheduled if s.start_pos >= s.request.num_prompt_tokens)
        self.tracer.complete("step", "engine", start_us, now_us(), {
            "requests": len(output.scheduled), "decode_tokens": num_decode,
            "prefill_tokens": output.total_num_scheduled_tokens - num_decode,
            "threads": threads, "preempted": len(output.preempted_request_ids)})

    def _gather_burst(self, gap_s: float) -> None:
        """Take arrivals (ops) until none comes for `gap_s`, for at most 10 * `gap_s`.

        NOTE: without this a burst reaching an idle engine starts with a step over whatever
        arrived first (one random prompt, ~0.3 s of prefill on 2 cores) while the rest
        queue behind it; the scheduler can only order what it has.
        """
        deadline = time.monotonic() + 10 * gap_s
        while not self._stopped:
            self._wake.clear()
            took = not self._ops.empty()
            self._run_ops()
            # Publish the work on the host's core board now: another engine of this host
            # ending its own gathering first must see this burst's shorter prompts before
            # it starts a long prefill step.
            self.engine_core.acquire_cores()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (not took and not self._wake.wait(min(gap_s, remaining))):
                break
        self.last_step_time = time.monotonic()

    def _run_ops(self) -> None:
        while True:
            try:
                fn, loop, fut = self._ops.get_nowait()
            except queue.Empty:
                return
            try:
                result: Any = fn(self.engine_core)
            except BaseException as e:  # delivered to the caller, never kills the loop
                if loop is None:  # nobody waits for it (request_abort)
                    logger.exception("engine op failed")
                else:
                    loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                if loop is not None:
                    loop.call_soon_threadsafe(_set_result, fut, result)

    def _dispatch(self, items: list[EngineCoreOutput] | list[EngineStepError]) -> None:
        # NOTE: one call_soon_threadsafe per event loop per step, not one per request: each
        # call wakes the loop through its self-pipe, and a batch of 64 decodes would wake it
        # 64 times a step.
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for item in items:
            stream = self._streams.get(item.request_id)
            if stream is not None:
                loop, q = stream
                batches.setdefault(loop, []).append((q, item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)

    def _add_op(self, request: Request, validated: bool = False) -> None:
        if request.request_id in self.aborting:  # aborted before it was added: end it here
            self._dispatch([EngineCoreOutput(request.request_id, [], [], FinishReason.ABORT,
                                             None)])
            return
        self.engine_core.add_request(request, validated=validated)

    def _abort_op(self, request_ids: list[str]) -> list[str]:
        ids = [r.request_id for r in self.engine_core.abort_requests(request_ids)]
        self._dispatch([EngineCoreOutput(i, [], [], FinishReason.ABORT, None) for i in ids])
        return ids

    def _fail_all(self, error: Exception) -> None:
        """Drop every request the engine holds (blocks freed); their streams raise."""
        ids = [r.request_id for r in
               self.engine_core.abort_requests(list(self.engine_core.scheduler.requests))]
        # NOTE: blocks are cached when allocated, before the step writes them: the failed
        # step's may hold no KV. Dropped, when no transfer holds a block (else they stay).
        if not self.engine_core.kv_cache_manager.reset_prefix_cache():
            logger.warning("prefix cache kept after a failed step: a KV transfer holds blocks")
        message = f"engine step failed: {type(error).__name__}: {error}"
        self._dispatch([EngineStepError(message, request_id) for request_id in ids])


def _deliver(batch: list[tuple[asyncio.Queue, EngineCoreOutput | EngineStepError]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


def _set_result(fut: asyncio.Future, result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
