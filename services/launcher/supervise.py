"""Supervisor: after startup, what the launcher does when a child exits on its own.

    prefill / decode / redis exits (before its first ready too) ─▶ log the code and its
      last lines ─▶ backoff (1, 2, 4 ... 30 s; reset after 60 s up)
      ─▶ its ports free? ── no ─▶ next backoff
                   └─ yes ─▶ start it again (same argv, env, ports, cores) ─▶ "ready again"
    gateway exits (or any child with restarts off) ─▶ stop everything

The gateway fails over between instances and answers 503 while none serves, so one engine's
death must not take the service down; nor must Redis's: it holds a cache (the registry and
prefix index), the gateway places from its last view meanwhile, and the instances register
and republish into the restarted (empty) Redis within a heartbeat.

NOTE: `tick` starts children: call it from the main thread only (the parent-death signal
belongs to the thread that forked the child, see process.py). Shutdown is the caller's:
it stops calling `tick`, so a child waiting out its backoff is never started again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

RESTARTABLE_ROLES = ("prefill", "decode", "redis")


class Child(Protocol):
    """What the supervisor needs of a child (services.launcher.process.ChildProcess)."""

    name: str

    def poll(self) -> int | None: ...
    def start(self) -> None: ...
    def kill(self) -> None: ...
    def last_lines(self) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """Seconds before restart number `n` (1-based) of a child that keeps dying."""

    initial: float = 1.0
    cap: float = 30.0
    reset_after: float = 60.0
    """A child that ran at least this long before it exited starts again at `initial`."""

    def delay(self, n: int) -> float:
        return min(self.initial * 2 ** max(n - 1, 0), self.cap)


@dataclass(slots=True)
class _Entry:
    child: Child
    ports: tuple[int, ...]
    restartable: bool
    started_at: float
    failures: int = 0
    """Restarts in a row of a child that ran less than `reset_after` each time."""
    restart_at: float | None = None
    """When a dead child is due to start again; None while it runs."""
    died_at: float | None = None
    """When it first exited in the current outage (cleared once it is healthy again)."""
    ever_ready: bool = False
    """Its health check passed once (set by `mark_ready` or a recovery)."""


class Supervisor:
    def __init__(self, children: Sequence[tuple[Child, tuple[int, ...], bool]],
                 say: Callable[[str], None], *, restart: bool = True,
                 backoff: Backoff = Backoff(),
                 busy_ports: Callable[[tuple[int, ...]], list[int]] = lambda ports: [],
                 healthy: Callable[[Child], bool] = lambda child: True,
                 clock: Callable[[], float] = time.monotonic, ready: bool = True) -> None:
        """`children`: (child, its ports, may it be restarted) for every started child;
        `busy_ports(ports)`: those still bound by someone; `healthy(child)`: its health
        check passes (asked only while a restarted child recovers); `ready`: the children
        have passed their first health check (False: the launcher calls `mark_ready`)."""
        self.say = say
        self.restart = restart
        self.backoff = backoff
        self.busy_ports = busy_ports
        self.healthy = healthy
        self.clock = clock
        now = clock()
        self._entries = [_Entry(c, tuple(p), r, now, ever_ready=ready)
                         for c, p, r in children]
        self.restarts = 0
        """Children started again so far."""

    def mark_ready(self, child: Child) -> None:
        """The launcher saw `child` pass its first health check."""
        for e in self._entries:
            if e.child is child:
                e.ever_ready = True

    def is_down(self, child: Child) -> bool:
        """`child` exited and waits out its backoff (not running now)."""
        return any(e.child is child and e.restart_at is not None for e in self._entries)

    def tick(self) -> str | None:
        """One pass over the children: reap, schedule, restart. Returns why everything must
        stop (a child that may not be restarted exited), else None."""
        for e in self._entries:
            now = self.clock()
            if e.restart_at is not None:
                if now >= e.restart_at:
                    self._start_again(e, now)
                continue
            code = e.child.poll()
            if code is None:
                if e.died_at is not None and self.healthy(e.child):
                    self.say(f"{e.child.name} is ready again, "
                             f"{self.clock() - e.died_at:.1f} s after it exited")
                    e.died_at = None
                    e.ever_ready = True
                continue
            when = "" if e.ever_ready else " before it was ready"
            why = f"{e.child.name} exited unexpectedly with code {code}{when}"
            self._say_last_lines(e.child)
            if not (self.restart and e.restartable):
                return f"{why}; stopping everything"
            e.child.kill()  # whatever it left behind in its process group (it may hold ports)
            self._schedule(e, now, why)
        return None

    def _say_last_lines(self, child: Child) -> None:
        """Why it died, as far as its own output tells: its last lines, quoted."""
        lines = getattr(child, "last_lines", lambda: [])()
        if lines:
            self.say(f"{child.name}'s last {len(lines)} log lines:")
            for line in lines:
                self.say(f"  | {line}")

    def _schedule(self, e: _Entry, now: float, why: str) -> None:
        if e.died_at is None:
            e.died_at = now
        if now - e.started_at >= self.backoff.reset_after:
            e.failures = 0
        e.failures += 1
        delay = self.backoff.delay(e.failures)
        e.restart_at = now + delay
        self.say(f"{why}; restarting it in {delay:g} s (restart {e.failures} in a row)")

    def _start_again(self, e: _Entry, now: float) -> None:
        e.started_at = now  # also when its ports are busy: it did not run, the backoff grows
        busy = self.busy_ports(e.ports)
        if busy:
            self._schedule(e, now, f"{e.child.name}: port {', '.join(map(str, busy))} "
                                   "still in use")
            return
        self.say(f"restarting {e.child.name}")
        try:
            e.child.start()
        except OSError as err:
            self._schedule(e, now, f"{e.child.name} did not start ({err})")
            return
        e.restart_at = None
        self.restarts += 1
