"""AdmissionQueue: the gateway's bounded waiting queue (429 + Retry-After beyond it).

Definitions (one gateway process):

- An *engine request* is one choice of one prompt: a completion with 2 prompts and n=3
  asks for 6.
- An admitted engine request is **waiting** from admission until its first token reaches the
  gateway (placement, the prefill instance's queue and compute, the first decode step), then
  **running** until it ends in any way (finish, stop string, error, client disconnect).
- `num_waiting` counts the waiting engine requests; `queued_tokens` sums their
  prompt + max_tokens.

A request for k engine requests of T tokens in all is admitted whole, or not at all, when

    num_waiting + k   <= max_num_queued_requests    (0: no bound)
    queued_tokens + T <= max_queued_tokens          (0: no bound)

otherwise it is refused with 429 and `Retry-After: s`: s is how long admitted requests have
recently waited for their first token (an EWMA), rounded up and clamped to [1, 60] seconds.
A request that could never fit (k > max_num_queued_requests or T > max_queued_tokens) is a
400 instead, since retrying cannot help. Running requests are bounded downstream: a decode
instance runs at most its max_num_seqs and answers RESOURCE_EXHAUSTED (429 here) past its
--max-waiting-requests.

Only the generation routes pass through here; /health, /metrics and the rest never wait.
Every admitted engine request leaves exactly once (`Grant.finish` / `Grant.release` are
idempotent), so the counters return to 0 whenever the gateway is idle.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.services.gateway.errors import GatewayError, bad_request

_WAITING, _RUNNING, _DONE = 0, 1, 2
_EWMA_WEIGHT = 0.2
MAX_RETRY_AFTER = 60


class QueueFullError(GatewayError):
    """429 with a `Retry-After` header (whole seconds)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, 429)
        self.retry_after = retry_after
        self.headers = {"Retry-After": str(retry_after)}


class AdmissionQueue:
    """The waiting / running counters of one gateway and the admission decision."""

    def __init__(self, max_num_queued_requests: int = 0, max_queued_tokens: int = 0,
                 registry: CollectorRegistry | None = None) -> None:
        self.max_num_queued_requests = max_num_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.num_waiting = 0
        self.num_running = 0
        self.queued_tokens = 0
        self.num_rejected = 0
        self.peak_waiting = 0
        self.mean_wait = 0.0
        """EWMA of the seconds admitted engine requests waited for their first token."""
        self._rejected = None
        if registry is not None:
            self._register(registry)

    def _register(self, r: CollectorRegistry) -> None:
        Gauge("pdserve_gateway_num_engine_requests_waiting",
              "Admitted engine requests without their first token yet.",
              registry=r).set_function(lambda: self.num_waiting)
        Gauge("pdserve_gateway_num_engine_requests_running",
              "Engine requests generating (first token seen, not finished).",
              registry=r).set_function(lambda: self.num_running)
        Gauge("pdserve_gateway_queued_tokens",
              "Prompt + max_tokens of the waiting engine requests.",
              registry=r).set_function(lambda: self.queued_tokens)
        self._rejected = Counter("pdserve_gateway_requests_rejected",
                                 "HTTP requests refused with 429 by the waiting queue.",
                                 ["reason"], registry=r)

    @property
    def retry_after(self) -> int:
        """Seconds a refused client should wait: the recent first-token wait, rounded up."""
        return min(MAX_RETRY_AFTER, max(1, math.ceil(self.mean_wait)))

    def check_fits(self, num_requests: int, num_tokens: int = 0, param: str = "n") -> None:
        """Refuse what could never be admitted, even into an empty queue.

        Raises:
            GatewayError: 400 naming `param` (too many engine requests) or `max_tokens`.
        """
        max_reqs, max_tokens = self.max_num_queued_requests, self.max_queued_tokens
        if max_reqs and num_requests > max_reqs:
            raise bad_request(f"The request needs {num_requests} engine requests (prompts x "
                              f"n); the queue holds at most {max_reqs}.", param)
        if max_tokens and num_tokens > max_tokens:
            raise bad_request(f"The request needs {num_tokens} tokens (prompt + max_tokens of "
                              f"every choice); the queue holds at most {max_tokens}.",
                              "max_tokens")

    def admit(self, num_tokens: Sequence[int]) -> Grant:
        """Admit the engine requests of one HTTP request (prompt + max_tokens each).

        Raises:
            GatewayError: 400 when they could never fit the bounds.
            QueueFullError: 429 when they do not fit now.
        """
        k, total = len(num_tokens), sum(num_tokens)
        self.check_fits(k, total)
        max_reqs, max_tokens = self.max_num_queued_requests, self.max_queued_tokens
        reason = None
        if max_reqs and self.num_waiting + k > max_reqs:
            reason = "requests"
        elif max_tokens and self.queued_tokens + total > max_tokens:
            reason = "tokens"
        if reason is not None:
            self.num_rejected += 1
            if self._rejected is not None:
                self._rejected.labels(reason).inc()
            raise QueueFullError(
                f"The server is overloaded: {self.num_waiting} requests ({self.queued_tokens} "
                f"tokens) are waiting. Retry after {self.retry_after} s.", self.retry_after)
        self.num_waiting += k
        self.queued_tokens += total
        self.peak_waiting = max(self.peak_waiting, self.num_waiting)
        return Grant(self, list(num_tokens))

    def _leave(self, num_tokens: int, state: int, waited: float | None) -> None:
        if state == _WAITING:
            self.num_waiting -= 1
            self.queued_tokens -= num_tokens
        else:
            self.num_running -= 1
        if waited is not None:
            self.mean_wait += _EWMA_WEIGHT * (waited - self.mean_wait)


class Grant:
    """The admitted engine requests of one HTTP request, by choice index."""

    __slots__ = ("_queue", "_num_tokens", "_state", "_admitted_at")

    def __init__(self, queue: AdmissionQueue, num_tokens: list[int]) -> None:
        self._queue = queue
        self._num_tokens = num_tokens
        self._state = [_WAITING] * len(num_tokens)
        self._admitted_at = time.monotonic()

    def start(self, index: int) -> None:
        """Choice `index` got its first token: it stops waiting (no-op afterwards)."""
        if self._state[index] != _WAITING:
            return
        q = self._queue
        self._state[index] = _RUNNING
        q._leave(self._num_tokens[index], _WAITING, time.monotonic() - self._admitted_at)
        q.num_running += 1

    def finish(self, index: int) -> None:
        """Choice `index` ended, however it ended (no-op when already finished)."""
        state = self._state[index]
        if state != _DONE:
            self._state[index] = _DONE
            self._queue._leave(self._num_tokens[index], state, None)

    def release(self) -> None:
        """Finish every choice still held (the safety net on every exit path)."""
        for i in range(len(self._state)):
            self.finish(i)
