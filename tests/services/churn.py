"""ChurnEngine: a real Scheduler and KVCacheManager stepped with fake tokens (no model, no
torch), for driving a StateFeed with realistic block traffic: shared prefixes, prefix-cache
hits, preemptions, aborts. `feed(...)` builds the StateFeed a worker would, over it."""

from __future__ import annotations

import random
import time

from pdserve.services.common.state_feed import Counters, LoopSide, StateFeed, feed_op
from pdserve.services.common.worker import EngineState, stats_op
from pdserve.shared.config import SchedulerConfig
from pdserve.shared.engine.scheduler import Scheduler
from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.engine.test_scheduler import runner_output


class ChurnEngine:
    """Duck-types the EngineCore parts that feed_op, stats_op and AsyncEngine use.

    With `target_requests`, each step tops the scheduler up to that many requests (so an
    AsyncEngine keeps stepping), and `step_pause_s` sleeps after each step (leaving the GIL
    to the event loop, as a model step mostly does)."""
    last_step_scheduled = True  # AsyncEngine reads it after each step
    trace_file = None  # AsyncEngine reads it at start (no timeline)
    kv_offloader = None  # no disk tier (check_invariants_op, tier_snapshot_op read it)

    def __init__(self, num_blocks: int, block_size: int = 16, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512, seed: int = 0,
                 target_requests: int = 0,
                 max_prompt_blocks: int = 12, step_pause_s: float = 0.0) -> None:
        self.target_requests = target_requests
        self.max_prompt_blocks = max_prompt_blocks
        self.step_pause_s = step_pause_s
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, model_name="churn")
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=block_size * 512),
            self.kv_cache_manager)
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(1, 1000) for _ in range(block_size * n)]
                         for n in (2, 4, 8)]
        self.num_added = 0

    def add(self, n: int = 1, max_prompt_blocks: int | None = None,
            max_tokens: int = 24) -> None:
        bs = self.kv_cache_manager.block_size
        max_prompt_blocks = max_prompt_blocks or self.max_prompt_blocks
        for _ in range(n):
            prefix = self.rng.choice(self.prefixes) if self.rng.random() < 0.7 else []
            tail = [self.rng.randrange(1, 1000)
                    for _ in range(self.rng.randrange(1, max_prompt_blocks * bs))]
            self.num_added += 1
            self.scheduler.add_request(Request(
                f"churn-{self.num_added}", prefix + tail,
                SamplingParams(max_tokens=self.rng.randrange(1, max_tokens), ignore_eos=True)))

    def step(self) -> list:
        """One engine step with fake sampled tokens, plus an abort now and then."""
        missing = self.target_requests - len(self.scheduler.requests)
        if missing > 0:
            self.add(missing)
        out = self.scheduler.schedule()
        sampled = runner_output({s.request.request_id: self.rng.randrange(1, 1000)
                                 for s in out.scheduled if s.sample})
        deltas = self.scheduler.update_from_output(out, sampled)
        if self.scheduler.running and self.rng.random() < 0.05:
            self.scheduler.abort_requests([self.rng.choice(self.scheduler.running).request_id])
        if self.step_pause_s:
            time.sleep(self.step_pause_s)
        return deltas

    # -- what AsyncEngine calls --------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.target_requests > 0 or self.scheduler.has_unfinished_requests()

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.abort_requests(request_ids)

    def bind_stepping_thread(self) -> None:
        pass

    def mark_idle(self) -> None:
        pass

    def acquire_cores(self) -> int:
        return 1

    def shutdown(self) -> None:
        pass


def engine_state(stats, num_pinned: int) -> EngineState:
    return EngineState("churn", "decode", "churn", stats.num_gpu_blocks, stats.num_free_blocks,
                       stats.num_cached_blocks, stats.num_used_blocks, num_pinned,
                       stats.num_running, stats.num_waiting, True, "", 4096, 16)


def feed(engine: ChurnEngine, pinned: set[int] | None = None, on_sample=None,
         call=None) -> StateFeed:
    """A StateFeed over `engine`, its ops run inline (as the engine thread would, between
    steps) or through `call` (an AsyncEngine's); `pinned`: block ids to report as pinned;
    `on_sample(sample)` sees each sample."""
    pinned = pinned if pinned is not None else set()

    async def inline(fn):
        return fn(engine)

    call = call or inline

    async def sample(full: bool):
        s = await call(lambda e: feed_op(e, full, stats_op))
        if on_sample is not None:
            on_sample(s)
        return s

    async def stop_tracking():
        await call(lambda e: e.kv_cache_manager.block_pool.track_changes(False))

    return StateFeed(sample, lambda: LoopSide(frozenset(pinned), []), engine_state,
                     lambda: Counters(0, 0, None, None), stop_tracking)
