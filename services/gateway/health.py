"""The gateway's view of the engine: which prefill and decode instances can take work
(HealthTracker), and what the engine is (EngineInfo, from the instances' GetState).

    poll loop (every health_check_interval s, started lazily on the running loop)
      └─ grpc.health.v1 Check("") of every known instance, one call in flight per address
    mark_failed(address)      a call to it just failed: excluded at once, re-checked at once
    refresh(addresses, bound) live checks that wait at most `bound` seconds (/health,
                              placement when nothing is usable)
    report(prefill, decode)   /health: 200 while a decode instance serves (it prefills
                              locally when no prefill instance does), each degraded part
                              named in the body

The poll follows `instances()`: an instance that registers is checked from the next poll
on; one missing from the list for FORGET_AFTER_S (it left or its registration expired) is
forgotten, its channel closed once no call runs on it.

Status per address: SERVING, NOT_SERVING (loading, draining, stalled), UNREACHABLE (no
answer within the check timeout, or a failed call), UNKNOWN (never checked). Placement uses
every instance that is not NOT_SERVING or UNREACHABLE; `/health` counts SERVING ones.

NOTE: a SERVING answer to a check that started before the latest `mark_failed` of its address
is dropped: it may describe the instance from before the failure.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2

from pdserve.services.gateway.channel_pool import ChannelPool
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.errors import no_backend

logger = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
MISSES_UNTIL_UNREACHABLE = 2
"""Unanswered polls in a row before a SERVING instance counts as UNREACHABLE."""
FORGET_AFTER_S = 30.0
"""Seconds an address may be missing from `instances()` before its status is dropped."""
HEALTH_ROUTE_BOUND = 0.1
"""Seconds /health waits for live checks before it uses the last known states (the poll
keeps them at most `interval` old)."""
FIRST_CHECK_BOUND = 0.5
"""... or, while an instance was never checked (just started or registered), this long."""


class HealthReport(NamedTuple):
    can_serve: bool
    """A decode instance is SERVING: requests get answers (/health 200)."""
    body: dict[str, Any]
    """{"status": "ok" | "degraded" | "unavailable", "degraded": {part: why},
    "prefill" / "decode": {"serving": n, "instances": n}, "redis": {"up", "view_age_s"} |
    None} (README, Gateway `/health`)."""


class InstanceStatus(enum.Enum):
    UNKNOWN = "unknown"
    SERVING = "serving"
    NOT_SERVING = "not_serving"
    UNREACHABLE = "unreachable"

    @property
    def usable(self) -> bool:
        """May placement send work there? (UNKNOWN: yes, until a check says otherwise.)"""
        return self in (InstanceStatus.UNKNOWN, InstanceStatus.SERVING)


class HealthTracker:
    def __init__(self, channels: ChannelPool, instances: Callable[[], Awaitable[list[str]]],
                 interval: float = 1.0, check_timeout: float = 5.0) -> None:
        """`instances()` lists every address to poll (prefill and decode);
        `check_timeout`: seconds a polled instance has to answer before it is UNREACHABLE."""
        self.channels = channels
        self.instances = instances
        self.interval = interval
        self.check_timeout = check_timeout
        self._status: dict[str, InstanceStatus] = {}
        self._failed_at: dict[str, float] = {}
        self._misses: dict[str, int] = {}
        """Consecutive unanswered polls per address (a busy instance may miss one)."""
        self._missing_since: dict[str, float] = {}
        self._checks: dict[str, asyncio.Task] = {}
        """The latest check of each address; `_tasks` holds every one still running."""
        self._tasks: set[asyncio.Task] = set()
        self._poller: asyncio.Task | None = None
        self._closed = False

    def status(self, address: str) -> InstanceStatus:
        return self._status.get(address, InstanceStatus.UNKNOWN)

    def is_usable(self, address: str) -> bool:
        return self.status(address).usable

    def ensure_started(self) -> None:
        """Start the poll loop on the running event loop (idempotent; not after close)."""
        if not self._closed and (self._poller is None or self._poller.done()):
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    def mark_failed(self, address: str) -> None:
        """A call to `address` failed: exclude it now and check it again at once."""
        self._failed_at[address] = time.monotonic()
        self._set(address, InstanceStatus.UNREACHABLE, "a call failed")
        self._checks.pop(address, None)  # an older check's answer may predate the failure
        if not self._closed:
            self._check(address)

    async def refresh(self, addresses: Iterable[str], bound: float) -> None:
        """Check `addresses` now, waiting at most `bound` seconds; an instance that has not
        answered by then keeps its last known status (its check goes on in the background)."""
        tasks = [self._check(a) for a in dict.fromkeys(addresses)]
        if tasks:
            await asyncio.wait(tasks, timeout=bound)

    async def report(self, prefill: list[str], decode: list[str],
                     registry: Any = None, pooling: bool = False) -> HealthReport:
        """What /health says: each instance is checked live, but for at most
        HEALTH_ROUTE_BOUND s (one that has not answered by then counts with its last known
        status). `registry`: the placer's (a RegistryView: its `is_up` and `age`), None
        without Redis. Nothing here waits on Redis. `pooling`: a pooling model's deployment
        (prefill instances only): it can serve while a prefill instance does."""
        self.ensure_started()
        addresses = prefill + decode
        never_checked = any(a not in self._status for a in addresses)
        await self.refresh(addresses, FIRST_CHECK_BOUND if never_checked else
                           HEALTH_ROUTE_BOUND)
        degraded: dict[str, str] = {}
        body: dict[str, Any] = {}
        for role, listed in (("prefill", prefill), ("decode", decode)):
            serving = sum(self.status(a) is InstanceStatus.SERVING for a in listed)
            body[role] = {"serving": serving, "instances": len(listed)}
            if pooling and role == "decode" and not listed:
                continue  # none needed
            if serving < len(listed) or not listed:
                degraded[role] = f"{serving} of {len(listed)} {role} instances serving"
        if "prefill" in degraded and body["prefill"]["serving"] == 0 and not pooling:
            degraded["prefill"] += ": the decode instances prefill every prompt themselves"
        if registry is None:
            body["redis"] = None
        else:
            age = getattr(registry, "age", None)
            body["redis"] = {"up": bool(getattr(registry, "is_up", True)),
                             "view_age_s": None if age is None else round(age, 1)}
            if not body["redis"]["up"]:
                degraded["redis"] = ("unreachable: placing on the instances and cached prefixes "
                                     "last seen" + ("" if age is None else f", {age:.0f} s ago"))
        can_serve = body["prefill" if pooling else "decode"]["serving"] > 0
        status = "unavailable" if not can_serve else "degraded" if degraded else "ok"
        return HealthReport(can_serve, {"status": status, "degraded": degraded, **body})

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._poller, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._checks.clear()

    def _check(self, address: str) -> asyncio.Task:
        """The in-flight check of `address`, started if there is none."""
        task = self._checks.get(address)
        if task is None or task.done():
            task = self._checks[address] = asyncio.get_running_loop().create_task(
                self._run_check(address))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return task

    async def _run_check(self, address: str) -> None:
        started = time.monotonic()
        try:
            status = await self.channels.health_status(address, self.check_timeout)
        except Exception as e:  # e.g. the channel is being closed: count it as no answer
            logger.debug("health check of %s failed: %r", address, e)
            status = None
        finally:
            if self._checks.get(address) is asyncio.current_task():
                del self._checks[address]
        if status is None:
            # NOTE: one missed poll of a SERVING instance is forgiven: on a loaded machine a
            # busy engine process can answer late; a failed call (mark_failed) still counts
            # at once.
            misses = self._misses[address] = self._misses.get(address, 0) + 1
            if misses >= MISSES_UNTIL_UNREACHABLE or self.status(address) is not \
                    InstanceStatus.SERVING:
                self._set(address, InstanceStatus.UNREACHABLE, f"no answer ({misses}x)")
            return
        self._misses.pop(address, None)
        if status == _SERVING:
            if started >= self._failed_at.get(address, float("-inf")):
                self._set(address, InstanceStatus.SERVING, "SERVING")
        else:
            self._set(address, InstanceStatus.NOT_SERVING,
                      health_pb2.HealthCheckResponse.ServingStatus.Name(status))

    def _set(self, address: str, status: InstanceStatus, why: str) -> None:
        old = self._status.get(address, InstanceStatus.UNKNOWN)
        self._status[address] = status
        if old is not status:
            # Only losing a serving instance is worth a warning; an instance that is still
            # starting (unknown / unreachable -> not_serving on every normal start) is not.
            log = logger.warning if old is InstanceStatus.SERVING else logger.info
            log("instance %s: %s -> %s (%s)", address, old.value, status.value, why)

    def _forget_departed(self, listed: list[str]) -> None:
        now, listed_set = time.monotonic(), set(listed)
        for address in [a for a in self._status if a not in listed_set]:
            since = self._missing_since.setdefault(address, now)
            if now - since >= FORGET_AFTER_S and self.channels.forget(address):
                for known in (self._status, self._missing_since, self._failed_at, self._misses):
                    known.pop(address, None)
                logger.info("instance %s: gone from the registry for %.0f s, forgotten",
                            address, now - since)
        for address in [a for a in self._missing_since if a in listed_set]:
            del self._missing_since[address]

    async def _poll_forever(self) -> None:
        while True:
            try:
                addresses = await self.instances()
                for address in addresses:
                    self._check(address)
                self._forget_departed(addresses)
            except Exception:  # the registry may be down: keep polling what we can
                logger.exception("health poll failed")
            await asyncio.sleep(self.interval)


class EngineInfo(NamedTuple):
    max_model_len: int
    block_size: int
    model_name: str
    """The engine's served model name and weight quantization: prefix-hash extra keys."""
    quantization: str = "none"


async def discover_engine(config: GatewayConfig, channels: ChannelPool, prefill: list[str],
                          decode: list[str]) -> EngineInfo | None:
    """max_model_len and block size from the GetState of the instances (the flags win); None
    when none of them answers.

    Raises:
        GatewayError: 503 when no instance reports max_model_len and no flag gives it.
    """
    targets = [("decode", a) for a in decode] + [("prefill", a) for a in prefill]
    replies = await asyncio.gather(*(channels.get_state(a, r) for r, a in targets),
                                   return_exceptions=True)
    states = []
    for (role, address), reply in zip(targets, replies):
        if isinstance(reply, grpc.aio.AioRpcError):  # UNAVAILABLE: loading (every start)
            (logger.debug if reply.code() == grpc.StatusCode.UNAVAILABLE else logger.warning)(
                "GetState on %s %s failed: %s", role, address, reply.code().name)
        elif isinstance(reply, BaseException):
            raise reply
        else:
            states.append(reply)
    if not states:
        return None
    reported = [s.max_model_len for s in states if s.max_model_len > 0]
    max_model_len = config.max_model_len or (min(reported) if reported else 0)
    if not max_model_len:
        raise no_backend("the instances do not report max_model_len")
    if reported and max_model_len > min(reported):
        logger.warning("--max-model-len %d exceeds the engine's %d", max_model_len,
                       min(reported))
    model_name = states[0].model or config.served_model_name
    if model_name != config.served_model_name:
        logger.warning("the engine serves %r, the gateway %r: routing hashes use %r",
                       model_name, config.served_model_name, model_name)
    return EngineInfo(max_model_len, states[0].block_size or config.block_size, model_name,
                      states[0].quantization or "none")
