"""EngineWorker: what the prefill and decode workers share, and their engine-thread ops.

A worker owns one AsyncEngine. Every op that touches the scheduler or the KV cache manager
runs on the engine thread, between steps, through `AsyncEngine.call`; the functions named
`*_op` below are such ops (they take the EngineCore and must not block).

NOTE: control calls (Abort, ReleaseKV, GetState, health) never wait for a model step, which
can take seconds (a 2,048-token chunk on 2 cores): Abort and ReleaseKV answer from the
AsyncEngine's streams and the KV connector's table (shared/kv_transfer/connector.py) and
queue their engine op without awaiting it (the op runs before the next step is scheduled);
GetState waits for the engine thread at most STATE_WAIT_S. Who owns a request's blocks in
each state: docs/lifecycle.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import grpc

from pdserve.services.common import state_feed
from pdserve.services.common.config import ServiceConfig
from pdserve.services.common.errors import ServiceError
from pdserve.services.common.lora import LoRATable
from pdserve.services.common.metrics import EngineStats, ServiceMetrics
from pdserve.services.common.state_feed import Counters, LoopSide, StateFeed, TransferView
from pdserve.shared.engine.async_engine import AsyncEngine
from pdserve.shared.engine.engine_core import EngineCore
from pdserve.shared.engine.kv_offload import TierSnapshot
from pdserve.shared.kv_transfer.codec import KVLayout
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.request import RequestStatus

logger = logging.getLogger(__name__)


class Identity(NamedTuple):
    instance_id: str
    address: str
    """host:port others reach this instance's gRPC server at."""


class EngineState(NamedTuple):
    """The leak audit and load view (the fields of the proto EngineState)."""

    instance_id: str
    role: str
    model: str
    num_gpu_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    num_pinned_blocks: int
    num_running: int
    num_waiting: int
    invariants_ok: bool
    invariants_error: str
    max_model_len: int
    block_size: int
    quantization: str = "none"
    num_paused: int = 0


LORA_DRAIN_S = 30.0
"""How long an unloaded adapter's unfinished requests may run on before they are aborted."""

STATE_WAIT_S = {False: 0.5, True: 2.0}
"""How long GetState waits for the engine thread (without / with the invariant check)
before it answers from the counters alone."""


def stats_op(engine: EngineCore) -> EngineStats:
    s = engine.scheduler.make_stats()
    pool = engine.kv_cache_manager.block_pool
    num_free = pool.get_num_free_blocks()
    return EngineStats(
        num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
        num_preemptions=s.num_preemptions, prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits, num_gpu_blocks=pool.num_gpu_blocks,
        num_free_blocks=num_free, num_cached_blocks=pool.num_cached_blocks,
        num_used_blocks=pool.num_gpu_blocks - 1 - num_free, num_paused=s.num_paused)


def tier_snapshot_op(engine: EngineCore) -> TierSnapshot | None:
    """The KV tiers now (`KVOffloader.snapshot`); None without a disk tier."""
    off = engine.kv_offloader
    return None if off is None else off.snapshot(engine.kv_cache_manager.block_pool
                                                 .num_cached_blocks)


def lora_users_op(engine: EngineCore, lora_int_id: int) -> list[str]:
    """The unfinished requests running under the adapter `lora_int_id`."""
    return [v.request_id for v in engine.scheduler.request_views()
            if v.lora_request is not None and v.lora_request.lora_int_id == lora_int_id
            and not RequestStatus.is_finished(v.status)]


def check_invariants_op(engine: EngineCore) -> tuple[str, list[str]]:
    """("", []) when the KV cache manager's invariants hold and every request holding blocks
    is the scheduler's (unfinished, or finished and held for a KV transfer); else the broken
    invariant, or "" and the ids of the requests holding blocks that nothing owns."""
    try:
        engine.kv_cache_manager.check_invariants()
        if engine.kv_offloader is not None:
            engine.kv_offloader.check_invariants()
    except AssertionError as e:
        return str(e) or "AssertionError", []
    scheduler = engine.scheduler
    return "", [rid for rid, _ in state_feed.unowned(scheduler.request_views(),
                                                     scheduler.block_holders())]


class EngineWorker:
    """One instance's engine plus its service state.

    Args:
        engine: the engine, already running its thread.
        config: the service flags.
        identity: this instance's registry id and reachable address.
        metrics: this instance's Prometheus metrics.
        eos_token_id: the tokenizer's EOS id (stop rule of every request).
    """

    role = ""

    def __init__(self, engine: AsyncEngine, config: ServiceConfig, identity: Identity,
                 metrics: ServiceMetrics, eos_token_id: int | None) -> None:
        self.engine = engine
        self.config = config
        self.identity = identity
        self.metrics = metrics
        self.eos_token_id = eos_token_id
        self.engine_core: EngineCore = engine.engine_core
        """The engine's core (touch it on the engine thread only, through `engine.call`)."""
        core = self.engine_core
        self._active: set[str] = set()
        """Ids of the requests this worker serves now (`active`)."""
        self.model_name = core.model_config.served_model_name
        self.quantization = core.model_config.quantization
        self.max_model_len = core.model_config.max_model_len
        self.block_size = core.kv_cache_manager.block_size
        self.layout = KVLayout.of(core.model_runner.kv_caches)
        self._tasks: set[asyncio.Task] = set()
        self.lora = LoRATable(self.model_name)
        """The LoRA adapters loaded here (requests name them; the registry lists them)."""
        self.on_lora_change: Callable[[], Awaitable[object]] | None = None
        """Awaited after each load / unload (the runtime re-registers the instance)."""
        self._lora_lock = asyncio.Lock()
        self.state_feed = StateFeed(
            lambda full: self.engine.call(lambda e: state_feed.feed_op(e, full, stats_op)),
            lambda: LoopSide(self.pinned_block_ids(), self.transfers()), self.make_state,
            self._feed_counters,
            lambda: self.engine.call(lambda e: e.kv_cache_manager.block_pool.track_changes(
                False)))
        """The dashboard's live view of this instance (WatchState)."""

    # -- overridden by the roles -------------------------------------------------------------

    def num_pinned_blocks(self) -> int:
        """Blocks held for KV transfers (prefill)."""
        return len(self.pinned_block_ids())

    def num_in_flight(self) -> int:
        """Requests a drain waits for."""
        return len(self._active)

    def pinned_block_ids(self) -> frozenset[int]:
        """The blocks of num_pinned_blocks() (prefill)."""
        return frozenset()

    def transfers(self) -> list[TransferView]:
        """KV transfers in flight here (state feed)."""
        return []

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Abort without waiting for the engine thread; returns the ids known here."""
        return self.engine.request_abort(request_ids)

    # -- LoRA adapters -----------------------------------------------------------------------

    async def load_lora(self, lora: LoRARequest) -> None:
        """Load `lora` into the engine (idempotent for the same name and path).

        Raises:
            ServiceError: ALREADY_EXISTS (the name is loaded from another path),
                INVALID_ARGUMENT (another base model; a bad adapter: the engine's message,
                nothing already loaded harmed).
        """
        async with self._lora_lock:
            if not self.lora.check_new(lora):
                return
            try:
                await self.engine.call(lambda e: e.add_lora(lora))
            except ValueError as e:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"LoRA adapter {lora.lora_name!r}: {e}") from None
            self.lora.adapters[lora.lora_name] = lora
        await self._lora_changed()

    async def unload_lora(self, lora_name: str) -> bool:
        """Unload the adapter named `lora_name`; False when none of that name is loaded.

        New requests naming it are refused at once (NOT_FOUND); the unfinished ones under it
        finish first (as vLLM serves them to the end), for at most LORA_DRAIN_S, after which
        they are aborted; then the engine forgets the adapter.
        """
        async with self._lora_lock:
            lora = self.lora.adapters.pop(lora_name, None)
            if lora is None:
                return False
        await self._lora_changed()
        deadline = time.monotonic() + LORA_DRAIN_S
        while True:
            users = await self.engine.call(lambda e: lora_users_op(e, lora.lora_int_id))
            if not users:
                async with self._lora_lock:
                    if lora_name in self.lora.adapters:  # loaded again meanwhile
                        return True
                    try:
                        await self.engine.call(lambda e: e.remove_lora(lora.lora_int_id))
                        return True
                    except ValueError:  # a request admitted since: drain it too
                        pass
            elif time.monotonic() >= deadline:
                logger.warning("unloading LoRA adapter %s: aborting %d request(s) still "
                               "running under it", lora_name, len(users))
                await self.abort(users)
            await asyncio.sleep(0.05)

    async def _lora_changed(self) -> None:
        if self.on_lora_change is not None:
            await self.on_lora_change()

    # -- shared ------------------------------------------------------------------------------

    @contextmanager
    def active(self, request_id: str, in_use: str) -> Iterator[None]:
        """Serve `request_id` in this block. Raises ServiceError(ALREADY_EXISTS), saying
        "request <id> <in_use>", while another call serves the same id."""
        if request_id in self._active:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} {in_use}")
        self._active.add(request_id)
        try:
            yield
        finally:
            self._active.discard(request_id)

    async def get_state(self, check_invariants: bool = False) -> EngineState:
        """The state, from the engine thread between steps; while a step runs longer than
        STATE_WAIT_S (or the thread is stuck), from its O(1) counters read here instead,
        with the invariants reported as not checked (GetState must answer however busy)."""
        # NOTE: the pins are read as the op is queued, not when it answers: a pin not counted
        # then has its free queued ahead of the op (KVConnector.sending), so the op's used
        # blocks include no unpinned transfer's. Read after, a ReleaseKV answered meanwhile
        # showed 0 pinned beside its still used blocks.
        num_pinned_blocks = self.num_pinned_blocks()
        try:
            stats, (error, orphans) = await asyncio.wait_for(self.engine.call(
                lambda e: (stats_op(e),
                           check_invariants_op(e) if check_invariants else ("", []))),
                STATE_WAIT_S[check_invariants])
        except TimeoutError:
            stats, orphans = stats_op(self.engine_core), []
            num_pinned_blocks = self.num_pinned_blocks()
            error = (f"not checked: the engine has been in a step for "
                     f"{self.engine.seconds_in_step():.1f} s") if check_invariants else ""
        if orphans and not error:
            error = f"blocks held by {len(orphans)} requests nothing owns: {orphans[:8]}"
        return self.make_state(stats, num_pinned_blocks, error)

    def make_state(self, stats: EngineStats, num_pinned_blocks: int,
                   error: str = "") -> EngineState:
        """The EngineState of engine `stats` plus this worker's pins (GetState
        and every state-feed frame build it here: the same numbers)."""
        return EngineState(
            instance_id=self.identity.instance_id, role=self.role, model=self.model_name,
            num_gpu_blocks=stats.num_gpu_blocks, num_free_blocks=stats.num_free_blocks,
            num_cached_blocks=stats.num_cached_blocks, num_used_blocks=stats.num_used_blocks,
            num_pinned_blocks=num_pinned_blocks, num_running=stats.num_running,
            num_waiting=stats.num_waiting, invariants_ok=not error,
            invariants_error=error, max_model_len=self.max_model_len,
            block_size=self.block_size, quantization=self.quantization,
            num_paused=stats.num_paused)

    def _feed_counters(self) -> Counters:
        m = self.metrics
        return Counters(int(m.value("prompt_tokens_total")),
                        int(m.value("generation_tokens_total")),
                        m.histogram("time_to_first_token_seconds"),
                        m.histogram("inter_token_latency_seconds"), m.kv_tier_views())

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` in the background, kept alive until done (shutdown awaits them)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Let background calls (ReleaseKV...) finish briefly, then cancel the rest. The
        engine itself is shut down by the runtime."""
        await self.state_feed.aclose()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.rpc_timeout)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
