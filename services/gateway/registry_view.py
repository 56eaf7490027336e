"""RegistryView: the gateway's local copy of the Redis registry and prefix index, refreshed in
the background, so that placement, /health and /metrics never wait on Redis.

    refresh task, every REFRESH_INTERVAL s ─▶ PrefixIndex.snapshot(generations held here)
      answered:  the instances and their held sets replace the view (a held set is copied
                 only when its generation moved); a new Redis run id (Redis restarted, empty)
                 keeps the instances it lost for one registration TTL, while they register
                 and republish again (a heartbeat)
      no answer: the last view stays (`is_up` False, `age` grows); the health checks still
                 weed out instances that died meanwhile
    live_instances(role) / longest_prefix(block_hashes)   answered from memory at once

It answers placement.InstanceRegistry's two methods, so the placer and the metrics federation
read it where they read the PrefixIndex before. Losing Redis costs what the view no longer
learns (instances that join, fresh load figures and cached prefixes), never an answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

from pdserve.services.common.prefix_index import InstanceInfo, PrefixIndex

logger = logging.getLogger(__name__)

REFRESH_INTERVAL = 1.0
"""Seconds between reads of the registry (instances heartbeat every 3 s)."""


class _Listed(NamedTuple):
    info: InstanceInfo
    generation: str
    held: frozenset[bytes]


class RegistryView:
    def __init__(self, index: PrefixIndex, interval: float = REFRESH_INTERVAL,
                 keep_after_restart: float | None = None) -> None:
        """`keep_after_restart`: seconds the instances a restarted Redis lost stay in the
        view (default: the registration TTL)."""
        self.index = index
        self.interval = interval
        self.keep_after_restart = index.ttl if keep_after_restart is None else \
            keep_after_restart
        self.is_up = False
        """The latest refresh was answered."""
        self.refreshed_at: float | None = None
        """time.monotonic() of the latest answered refresh; None before the first."""
        self._listed: dict[str, _Listed] = {}
        self._run_id: str | None = None
        self._keep_until = 0.0
        self._task: asyncio.Task | None = None
        self._tried = False
        """refresh() ran at least once (start() does it before the loop)."""
        self._closed = False

    @property
    def age(self) -> float | None:
        """Seconds since the view was last refreshed; None if it never was."""
        return None if self.refreshed_at is None else time.monotonic() - self.refreshed_at

    async def start(self) -> None:
        """The first refresh (bounded by the index's socket timeout), then the loop."""
        await self.refresh()
        self.ensure_started()

    def ensure_started(self) -> None:
        """Start the refresh loop on the running event loop (idempotent; not after close)."""
        if not self._closed and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.index.close()

    async def live_instances(self, role: str | None = None) -> list[InstanceInfo]:
        self.ensure_started()
        return [e.info for e in self._listed.values() if role is None or e.info.role == role]

    async def longest_prefix(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """instance_id -> how many leading `block_hashes` it holds (at least one)."""
        self.ensure_started()
        out = {}
        for instance_id, listed in self._listed.items():
            n = 0
            while n < len(block_hashes) and block_hashes[n] in listed.held:
                n += 1
            if n:
                out[instance_id] = n
        return out

    async def refresh(self) -> bool:
        """Read the registry once; False (the view unchanged) when Redis did not answer."""
        self._tried = True
        known = {i: e.generation for i, e in self._listed.items() if e.generation}
        snapshot = await self.index.snapshot(known)
        if snapshot is None:
            if self.is_up:
                logger.warning("Redis does not answer: placing on the %d instances last seen",
                               len(self._listed))
            self.is_up = False
            return False
        now = time.monotonic()
        if self._run_id is not None and snapshot.run_id != self._run_id:
            self._keep_until = now + self.keep_after_restart
            logger.warning("Redis restarted: the %d instances it lost stay in the view for "
                           "%g s while they register again", len(self._listed),
                           self.keep_after_restart)
        self._run_id = snapshot.run_id
        listed = {}
        for info, generation, held in snapshot.instances:
            old = self._listed.get(info.instance_id)
            if held is None:  # unchanged since our copy
                held = old.held if old is not None else frozenset()
            listed[info.instance_id] = _Listed(info, generation, held)
        if now < self._keep_until:
            for instance_id, old in self._listed.items():
                listed.setdefault(instance_id, old)
        if not self.is_up and self.refreshed_at is not None:
            logger.info("Redis answers again: %d instances registered", len(snapshot.instances))
        self._listed = listed
        self.is_up = True
        self.refreshed_at = now
        return True

    async def _refresh_forever(self) -> None:
        if self._tried:  # start() has just refreshed
            await asyncio.sleep(self.interval)
        while True:
            try:
                await self.refresh()
            except Exception:  # keep the last view; try again at the next interval
                logger.exception("registry refresh failed")
            await asyncio.sleep(self.interval)
