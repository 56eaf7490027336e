"""EngineCore: scheduler + KV cache manager + model runner, stepped in a loop.

One class serves both roles and the offline `LLM`. Its `kv_connector` holds a finished
prefill's blocks for the decode instance that fetches them (only requests that ask for it:
see shared/kv_transfer/connector.py). `step()` is nano-vllm's: schedule, execute_model,
update_from_output (the loop drawn in scheduler.py's docstring).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Container

import torch

from pdserve.shared.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pdserve.shared.engine.core_share import NO_PREFILL, CoreShare
from pdserve.shared.engine.kv_offload import make_offloader
from pdserve.shared.engine.model_runner import ModelRunner
from pdserve.shared.engine.scheduler import Scheduler
from pdserve.shared.engine.scheduler_output import SchedulerOutput
from pdserve.shared.engine.scheduling_policy import (
    freeing_window,
    validate_request,
    window_chunk_config,
)
from pdserve.shared.engine.slo_budget import PrefillBudget, TTFTUnreachableError
from pdserve.shared.engine.spec_decode.config import SpeculativeConfig
from pdserve.shared.engine.spec_decode.scheduling import make_proposer, propose_drafts
from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.kv_transfer.connector import KVConnector
from pdserve.shared.lora.admission import LoRAAdmission, LoRAStats, lora_stats
from pdserve.shared.lora.model_manager import LoRAModelManager
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.request import Request
from pdserve.shared.structured_output.backend import XgrammarBackend
from pdserve.shared.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def apply_cpu_placement(parallel_config: ParallelConfig, threads: int | None = None) -> int:
    """Bind this process to its cores and size the calling thread's torch pool: to
    `threads` when given, else to the configured count. Returns the configured count
    (`num_threads`, else the number of bound cores, else of the cores this process may use).

    NOTE: OpenMP keeps one worker pool per thread that starts parallel regions, and once a
    process has more pool threads than cores (GOMP's `gomp_managed_threads`) every worker
    stops spinning between regions and sleeps, so each of a step's few hundred regions
    pays a futex wake-up: a batch-1 decode step measured 49 ms instead of 34 here. So in a
    service only the engine thread runs multi-threaded regions (`bind_stepping_thread`);
    the event loop and the loader run with `threads=1`.
    """
    cores = parallel_config.cpu_cores
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    configured = parallel_config.num_threads or len(cores) or available or \
        torch.get_num_threads()
    torch.set_num_threads(threads or configured)
    return configured


def open_core_share(parallel_config: ParallelConfig) -> CoreShare | None:
    """The host's core board named by `parallel_config.core_share`, sized by this process's
    cores (its binding, else its affinity); None when not configured."""
    if not parallel_config.core_share:
        return None
    cores = parallel_config.cpu_cores
    if not cores and hasattr(os, "sched_getaffinity"):
        cores = tuple(os.sched_getaffinity(0))
    share = CoreShare(parallel_config.core_share, len(cores) or (os.cpu_count() or 1))
    logger.info("core share: slot %d of %s over %d cores", share.slot,
                parallel_config.core_share, share.num_cores)
    return share


class EngineCore:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, parallel_config: ParallelConfig,
                 enable_kv_cache_events: bool = False, load_threads: int | None = None,
                 speculative_config: SpeculativeConfig | None = None,
                 lora_config: LoRAConfig | None = None) -> None:
        self.num_threads = apply_cpu_placement(parallel_config, load_threads)
        """Threads of the stepping thread's pool (without a core share)."""
        self.core_share = open_core_share(parallel_config)
        """This engine's slot on the host's core board; None: a fixed thread count."""
        self.max_decode_stall_ns = int(parallel_config.max_decode_stall_s * 1e9)
        self.max_yield_ns = int(parallel_config.max_yield_s * 1e9)
        self.slo_tpot_s = parallel_config.slo_tpot_s
        self.tpot_reserve_s = parallel_config.tpot_reserve_s or 2 * parallel_config.slo_tpot_s
        self._yielding_since_ns = 0
        """When this engine began waiting for another engine's step (0: it is not)."""
        self.trace_file = parallel_config.trace_file
        """Where the serving loop (AsyncEngine) appends its timeline; empty: none."""
        self.last_scheduler_output: SchedulerOutput | None = None
        """The last step's schedule (the timeline reads it after the step)."""
        self._last_step_end_ns = 0
        self.last_step_scheduled = False
        """Whether the last step scheduled any token (AsyncEngine waits for an op if not)."""
        self.model_config = model_config
        self.structured_output = StructuredOutputManager(
            XgrammarBackend(model_config.model_path, model_config.vocab_size))
        """Grammar compiles (off this thread) and the guided rows' logit masks."""
        self.model_runner = ModelRunner(model_config, cache_config, parallel_config,
                                        self.structured_output, lora_config)
        self.lora_config = lora_config
        """Multi-LoRA serving (`add_lora`, shared/lora/); None: off, no LoRA layers."""
        self.num_gpu_blocks = self.model_runner.num_gpu_blocks
        self.kv_cache_manager = KVCacheManager(
            self.num_gpu_blocks, cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            model_name=model_config.served_model_name,
            quantization=model_config.quantization,
            # NOTE: only services drain take_events() (for the Redis index); an offline
            # engine would accumulate them forever.
            enable_kv_cache_events=enable_kv_cache_events,
            sliding_window=freeing_window(self.model_runner.model, speculative_config))
        self.kv_connector = KVConnector()
        """When finished prefills' blocks are freed (held for a KV transfer until done)."""
        long_rows = self.model_runner.long_rows
        scheduler_config = window_chunk_config(scheduler_config,
                                               self.kv_cache_manager.sliding_window,
                                               cache_config.block_size, self.num_gpu_blocks)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager, self.kv_connector,
                                   long_rows.original if long_rows is not None else None)
        self.kv_offloader = self.scheduler.kv_transfers.offloader = make_offloader(
            model_config.model_path, model_config.dtype, model_config.quantization,
            cache_config.kv_offload_dir, cache_config.kv_offload_size,
            self.model_runner.kv_caches, self.kv_cache_manager)
        """The disk tier (`--kv-offload-dir`, shared/engine/kv_offload.py); None: none."""
        if lora_config is not None:
            self.scheduler.lora_admission = LoRAAdmission(lora_config.max_loras)
        self.prefill_budget = (
            PrefillBudget(parallel_config.slo_tpot_s, scheduler_config.max_num_batched_tokens,
                          min_prefill_tokens=cache_config.block_size,
                          slo_ttft_s=parallel_config.slo_ttft_s)
            if parallel_config.slo_tpot_s > 0 or parallel_config.slo_ttft_s > 0 else None)
        """With a TPOT target: each step's prompt tokens beside running decodes are capped
        by the streams' slack (slo_budget.py); with a TTFT target: new prompts' first tokens
        are predicted (`check_ttft_reachable`); None: no targets, only the token budget."""
        self.slo_early_reject = parallel_config.slo_early_reject
        """Refuse a new prompt predicted to miss the TTFT target (TTFTUnreachableError)."""
        self.num_ttft_unreachable = 0
        """New prompts predicted, at arrival, to miss the TTFT target (served or refused)."""
        self.num_ttft_rejected = 0
        """Of those, refused (`--slo-early-reject`)."""
        self.aborts_arrived: Container[str] = frozenset()
        """Ids whose abort has arrived but may not be applied yet (AsyncEngine's `aborting`,
        written by another thread: only membership is read here)."""
        self.num_prompt_tokens_after_abort = 0
        """Prompt tokens computed by steps that ended after their request's abort arrived:
        work for nobody (at most the chunk of the step in flight when the abort came)."""
        self.speculative_config = speculative_config
        """Speculative decoding (drafts proposed after each step); None: off."""
        self.drafter = (make_proposer(speculative_config, model_config, self.model_runner)
                        if speculative_config else None)
        """The proposer (n-gram or draft model); None: speculation off."""
        if speculative_config is not None:
            logger.info("speculative decoding: %s", speculative_config)
        logger.info("engine ready: %d KV blocks of %d tokens, max_num_seqs=%d, "
                    "max_num_batched_tokens=%d", self.num_gpu_blocks, cache_config.block_size,
                    scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this engine holds by kind (`ModelRunner.memory_bytes`)."""
        return self.model_runner.memory_bytes()

    def validate_request(self, request: Request) -> None:
        """`scheduling_policy.validate_request` under this engine's limits: ValueError naming
        the field for a request the engine cannot serve."""
        config = self.scheduler.scheduler_config
        chunk = config.max_num_batched_tokens
        if config.long_prefill_token_threshold > 0:
            chunk = min(chunk, config.long_prefill_token_threshold)
        validate_request(request, self.model_runner.args.vocab_size,
                         self.model_config.max_model_len, self.kv_cache_manager.block_size,
                         self.num_gpu_blocks, self.kv_cache_manager.sliding_window, chunk)
        priority = request.sampling_params.priority
        if priority and self.scheduler.scheduler_config.scheduling_policy != "priority":
            raise ValueError(f"priority: got priority {priority}, but priority scheduling is "
                             "not enabled (--scheduling-policy priority)")

    def add_request(self, request: Request, validated: bool = False) -> None:
        """Validate and queue a request. Raises ValueError for bad input; nothing is queued.
        (A guided request's grammar: see structured_output/manager.py; the offline engine
        blocks here until it is compiled.) `validated`: the caller ran `validate_request` on
        this request already (the decode service, before it holds blocks or fetches KV), so
        it runs once per request."""
        if not validated:
            self.validate_request(request)
        if request.block_hasher is None:  # hashed once, before the TTFT check reads them
            request.set_block_hasher(self.kv_cache_manager.block_hasher)
        if request.lora_request is not None:
            self._lora_manager().check_request(request.lora_request, self._loras_in_use())
        self.check_ttft_reachable(request)
        self.structured_output.init_request(request)
        self.scheduler.add_request(request)

    # -- LoRA adapters (shared/lora/; vLLM's add_lora / remove_lora / list_loras) ------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a PEFT adapter (validated against this model), for requests to name.

        Raises:
            ValueError: one line (LoRA off, missing files, another base model's shapes, a
                rank over max_lora_rank, an unsupported target module or feature, an id or
                name taken); adapters already loaded are unharmed.
        """
        self._lora_manager().add_adapter(lora_request, self._loras_in_use())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False when none has that id.

        Raises:
            ValueError: unfinished requests use it (they are not aborted: finish or abort
                them first).
        """
        users = sum(1 for r in self.scheduler.requests.values()
                    if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id)
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} is used by {users} unfinished "
                             "request(s); finish or abort them first")
        return self._lora_manager().remove_adapter(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded (empty with LoRA off)."""
        manager = self.model_runner.lora_manager
        return set(manager.registered) if manager is not None else set()

    def lora_stats(self) -> LoRAStats:
        """Running and waiting adapters' names, and max_loras (vllm:lora_requests_info)."""
        s = self.scheduler
        return lora_stats(s.running, [*s.waiting, *s.kv_transfers.waiting_for_remote_kvs.values()],
                          self.lora_config.max_loras if self.lora_config else 0)

    def _lora_manager(self) -> LoRAModelManager:
        if self.model_runner.lora_manager is None:
            raise ValueError("lora_request: LoRA is not enabled on this engine (--enable-lora)")
        return self.model_runner.lora_manager

    def _loras_in_use(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.scheduler.requests.values()
                if r.lora_request is not None}

    def check_ttft_reachable(self, request: Request) -> None:
        """With a TTFT target, predict a new prompt's first token (`PrefillBudget.
        predict_ttft_s`, a lower bound); one predicted past the target is counted
        (`num_ttft_unreachable`) and logged, and with `slo_early_reject` refused when the load
        is the cause (on an idle engine, with no wait, it would keep the target: a retry can
        succeed). A prompt that would miss even on an idle engine is served: refusing it
        would refuse it on every retry.

        Raises:
            TTFTUnreachableError: refused (nothing queued, no block held).
        """
        budget = self.prefill_budget
        if budget is None or budget.slo_ttft_s <= 0 or request.output_token_ids or \
                not budget.recent_s_per_token:
            return
        cached = self.kv_cache_manager.get_computed_blocks(request).num_computed_tokens
        predicted = budget.predict_ttft_s(request, cached, self.scheduler.waiting,
                                          self.scheduler.running,
                                          self.scheduler.scheduler_config, time.monotonic())
        if predicted is None or predicted <= budget.slo_ttft_s:
            return
        self.num_ttft_unreachable += 1
        # NOTE: refuse only a prompt that the queue ahead makes miss: one that would miss
        # even alone (a long prompt on this hardware) would miss on every retry too.
        alone = budget.predict_ttft_s(request, cached, (), (), self.scheduler.scheduler_config,
                                      request.arrival_time)  # no queue, no wait
        if not self.slo_early_reject or (alone is not None and alone > budget.slo_ttft_s):
            logger.info("[%s] predicted to miss the TTFT target: first token at %.2f s "
                        "(target %.2f s; alone %.2f s); served", request.request_id,
                        predicted, budget.slo_ttft_s, alone or 0.0)
            return
        self.num_ttft_rejected += 1
        raise TTFTUnreachableError(request.request_id, predicted, budget.slo_ttft_s)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Abort now; their blocks go back to the pool at once."""
        aborted = self.scheduler.abort_requests(request_ids)
        if self.drafter is not None:
            self.drafter.remove_requests([r.request_id for r in aborted])
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def mark_idle(self) -> None:
        """Tell the host's other engines that this one has no work (core share only)."""
        if self.core_share is not None:
            self.core_share.update(busy=False)

    def shutdown(self) -> None:
        self.structured_output.close()
        if self.kv_offloader is not None:
            self.kv_offloader.shutdown()  # flushes the writes queued
        if self.core_share is not None:
            self.core_share.close()

    def bind_stepping_thread(self) -> None:
        """Size the calling thread's torch pool for steps (AsyncEngine's thread calls it
        first: OpenMP's thread count is per calling thread)."""
        torch.set_num_threads(self.num_threads)

    def acquire_cores(self) -> int:
        """Before a step: take this engine's share of the host's cores (core share only) and
        size torch's thread pool to it. Returns the thread count; 0 means another engine of
        the host has a shorter prefill to do and this one should wait (see core_share.py).
        Call it on the thread that steps (`bind_stepping_thread`)."""
        if self.core_share is None:
            return torch.get_num_threads()
        now = time.monotonic_ns()
        urgency, has_decodes = self.scheduler.prefill_urgency()
        # NOTE: with neither decodes nor a prefill (only KV admissions to book), a step costs
        # nothing: waiting for another engine's prefill would only delay those streams.
        can_yield = not has_decodes and urgency != NO_PREFILL
        if has_decodes and urgency == NO_PREFILL and self.max_decode_stall_ns > 0:
            # Only decodes: let a prefill engine of this host have the cores, until the
            # streams have waited max_decode_stall_s since this engine's last step.
            if now - self._last_step_end_ns < self.max_decode_stall_ns:
                can_yield = True
            else:
                urgency = 0  # due: the prefill engine waits for this one step
        elif has_decodes and urgency == NO_PREFILL and self.slo_tpot_s > 0:
            # Only decodes, with a TPOT target: the prefill engine gets every core while
            # each stream has more slack than the reserve; below it the cores are split.
            # NOTE: not "due" (urgency 0): fresh streams have no slack, so a decode engine
            # with arrivals would be due at every step and park the prefill engine for good
            # (seen in the timeline: prefill steps 0.5 s apart, the max_yield_s bound).
            can_yield = self.scheduler.min_tpot_slack(self.slo_tpot_s) > self.tpot_reserve_s
        if can_yield and self._yielding_since_ns and \
                now - self._yielding_since_ns >= self.max_yield_ns:
            urgency, can_yield = 0, False  # waited its bound: overdue, it takes a step
        threads = self.core_share.update(busy=True, urgency=urgency, can_yield=can_yield)
        if threads == 0:
            self._yielding_since_ns = self._yielding_since_ns or now
            return 0
        self._yielding_since_ns = 0
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads

    def step(self) -> list:
        """One scheduling + forward + sampling step; returns the EngineCoreOutputs."""
        budget = self.prefill_budget
        started = time.monotonic()
        scheduler_output = self.scheduler.schedule(None if budget is None else budget.cap(
            self.scheduler.running, started, self.scheduler.waiting))
        if self.drafter is not None and scheduler_output.preempted_request_ids:
            self.drafter.remove_requests(scheduler_output.preempted_request_ids)
        self.last_step_scheduled = bool(scheduler_output.scheduled)
        if not self.last_step_scheduled:
            return []
        self.last_scheduler_output = scheduler_output
        try:
            runner_output = self.model_runner.execute_model(scheduler_output)
        finally:
            self._last_step_end_ns = time.monotonic_ns()
        if budget is not None:
            num_decode = num_prefill = 0
            for s in scheduler_output.scheduled:
                n = s.num_scheduled_tokens - len(s.spec_token_ids)
                if n > 1:
                    num_prefill += n
                else:
                    num_decode += 1
            budget.observe(self._last_step_end_ns / 1e9 - started, num_decode, num_prefill)
        if self.aborts_arrived:
            self.num_prompt_tokens_after_abort += num_prompt_tokens_of(
                scheduler_output, self.aborts_arrived)
        deltas = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.drafter is not None:
            assert self.speculative_config is not None
            propose_drafts(self.drafter, self.speculative_config, self.scheduler.running,
                           self.scheduler.scheduler_config.max_model_len)
        finished = [d.request_id for d in deltas if d.finished]
        if finished and self.drafter is not None:
            self.drafter.remove_requests(finished)
        return deltas


def num_prompt_tokens_of(scheduler_output, request_ids: Container[str]) -> int:
    """Prompt tokens (positions < num_prompt_tokens) the step computed for `request_ids`."""
    return sum(max(0, min(s.start_pos + s.num_scheduled_tokens, s.request.num_prompt_tokens)
                   - s.start_pos)
               for s in scheduler_output.scheduled if s.request.request_id in request_ids)
