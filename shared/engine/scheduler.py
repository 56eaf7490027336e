"""Scheduler: continuous batching under a token budget, chunked prefill, preemption.

Role-agnostic. With a `kv_connector` (shared/kv_transfer/connector.py) a finished request
the connector delays (a prefill whose KV a decode instance will fetch) keeps its blocks, still
the scheduler's, until the connector reports its transfer done; see docs/lifecycle.md. It
owns `KVTransferTracker` (scheduler_kv_transfer.py) and `PausedRequests` (scheduler_pause.py);
services read it through `request_views()` and `block_holders()`, never its containers.

One engine step (synchronous, one step in flight at a time):

    out = scheduler.schedule()                        # pick tokens, allocate blocks
    runner_output = model_runner.execute_model(out)   # ModelRunnerOutput
    deltas = scheduler.update_from_output(out, runner_output)   # append tokens, stop, free

Call `add_request` / `abort_requests` between steps, not between `schedule()` and
`update_from_output()`. (An abort in between is tolerated: the step's result for that
request is dropped. Its freed blocks are only reused by the next schedule().)
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from pdserve.shared.config import SchedulerConfig
from pdserve.shared.engine.longrope import switch_to_long_rope
from pdserve.shared.engine.model_runner_output import ModelRunnerOutput
from pdserve.shared.engine.scheduler_kv_transfer import KVTransferTracker
from pdserve.shared.engine.scheduler_output import (
    EngineCoreOutput,
    RequestView,
    SchedulerOutput,
    SchedulerStats,
    StepBatch,
)
from pdserve.shared.engine.scheduler_pause import PausedRequests
from pdserve.shared.engine.scheduling_policy import (
    admission_order,
    min_tpot_slack,
    prefill_urgency,
    priority_key,
)
from pdserve.shared.engine.spec_decode.scheduling import append_sampled_tokens, num_spec_tokens
from pdserve.shared.engine.spec_decode.verification import SpecDecodingStats
from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.kv_transfer.connector import KVConnector
from pdserve.shared.kv_transfer.params import HeldBlocks, RemotePrefill
from pdserve.shared.lora.admission import LoRAAdmission
from pdserve.shared.pooling_params import finish_pooling, uses_prefix_hits
from pdserve.shared.request import Request, RequestStatus
from pdserve.shared.stop_rules import check_stop

__all__ = ["Scheduler", "check_stop"]


class Scheduler:
    """Decides, each step, which requests run and how many of their tokens.

    Args:
        scheduler_config: token budget, max_num_seqs, max_model_len, prefill chunk cap.
        kv_cache_manager: this instance's block bookkeeping.
        kv_connector: delays the free of finished requests' blocks for a KV transfer.
        longrope_original: a longrope model's original length, when its sequences can
            outgrow it (`RotaryEmbedding.long_rows`; shared/engine/longrope.py); else None.
    """
    lora_admission: LoRAAdmission | None = None  # the max_loras rule (shared/lora/admission.py)

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 kv_connector: KVConnector | None = None, longrope_original: int | None = None):
        self.scheduler_config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.longrope_original = longrope_original
        self.requests: dict[str, Request] = {}
        """Unfinished requests (waiting, preempted or running) by id."""
        self.waiting: deque[Request] = deque()
        """WAITING and PREEMPTED requests in arrival order (preempted ones at the left);
        `_admission_order()` says who is admitted first."""
        self.running: list[Request] = []
        """RUNNING requests in admission order; preemption takes from the end (newest)."""
        self.paused = PausedRequests()
        """PAUSED requests (`pause_requests`): never scheduled, out of both queues, not
        counted against max_num_seqs; they keep their blocks until preempted."""
        self.kv_transfers = KVTransferTracker(kv_cache_manager, kv_connector)
        """Requests whose blocks a KV transfer holds (with a `kv_connector`)."""
        self.num_preemptions = 0
        """Total preemptions since start-up."""
        self._finished_req_ids: list[str] = []
        self.spec_decoding_stats = SpecDecodingStats()
        """Speculative decoding counters (all 0 without speculation)."""

    # -- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue `request` at the back of the waiting queue (validated by the caller:
        `EngineCore.add_request` runs `scheduling_policy.validate_request`).

        A request that arrives with `num_computed_tokens > 0` must already hold blocks for
        those tokens in `kv_cache_manager` (KV written by a transfer); it is admitted
        without a prefix-cache lookup and computes only the rest.

        Raises:
            ValueError: duplicate request_id.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        if request.block_hasher is None:  # hashed now, once (EngineCore hands it earlier)
            request.set_block_hasher(self.kv_cache_manager.block_hasher)
        request.status = (RequestStatus.WAITING_FOR_REMOTE_KVS
                          if isinstance(request.kv_transfer_params, RemotePrefill)
                          else RequestStatus.WAITING)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Finish the given unfinished requests as FINISHED_ABORTED and free their blocks.

        Unknown or already finished ids are ignored (a finished request held for a transfer
        is freed when the connector closes it). Returns the aborted ones.
        """
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        aborted = []
        for request_id in request_ids:
            if (request := self.requests.get(request_id)) is not None:
                request.status = RequestStatus.FINISHED_ABORTED
                self._finish(request)
                aborted.append(request)
        if aborted:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
        return aborted

    def has_unfinished_requests(self) -> bool:
        """Whether a step could make progress: an unfinished request that is neither paused
        nor holding blocks a receive is filling, or a request aborted while a disk load
        fills its blocks (the step after the load ends frees them)."""
        return len(self.requests) > len(self.paused) + self.kv_transfers.num_receiving or \
            bool(self.kv_transfers.aborted_loading)

    def pause_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Make the given unfinished requests PAUSED (`PausedRequests.pause`: out of the
        running list and the waiting queue, blocks kept); returns the ids newly paused."""
        paused = self.paused.pause(self.requests[i] for i in request_ids if i in self.requests)
        if paused:
            self.running = [r for r in self.running if r.status != RequestStatus.PAUSED]
            self.waiting = deque(r for r in self.waiting if r.status != RequestStatus.PAUSED)
        return paused

    def resume_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Queue paused requests again (`PausedRequests.resume`); returns the ids resumed."""
        return self.paused.resume(request_ids, self.waiting)

    def preempt_paused(self) -> bool:
        """Free the KV of the longest-paused request holding blocks (it recomputes once
        resumed; reported in the next `preempted_request_ids`); False when none holds any."""
        request = self.paused.preempt_holder(self.kv_cache_manager)
        if request is not None:
            self._free_for_recompute(request)
        return request is not None

    def update_from_kv_xfer_finished(self) -> None:
        """Apply the KV transfers the connector reports ended (`KVTransferTracker.
        take_finished`): blocks freed, received requests queued like any."""
        self.waiting.extend(self.kv_transfers.take_finished())

    def request_views(self) -> tuple[RequestView, ...]:
        """Every request this scheduler holds, a snapshot: running (admission order),
        waiting (queue order), paused (pause order), then those a KV transfer holds."""
        kv = self.kv_cache_manager
        return (*(RequestView.of(r, kv) for r in (*self.running, *self.waiting, *self.paused)),
                *self.kv_transfers.views())

    def block_holders(self) -> Mapping[str, tuple[int, ...]]:
        """Request id -> its block ids (logical order), for every request the KV cache
        manager holds blocks for (a snapshot). One absent from `request_views()` is a leak."""
        kv = self.kv_cache_manager
        return MappingProxyType({request_id: tuple(kv.get_block_ids(request_id))
                                 for request_id in kv.req_to_blocks})

    num_running = property(lambda self: len(self.running))
    num_waiting = property(lambda self: len(self.waiting))

    def prefill_urgency(self) -> tuple[int, bool]:
        """`scheduling_policy.prefill_urgency` of this scheduler's queues (core share)."""
        return prefill_urgency(self.waiting, self.running, self.scheduler_config)

    def min_tpot_slack(self, slo_tpot_s: float) -> float:
        """`scheduling_policy.min_tpot_slack` of the running streams, now (core share)."""
        return min_tpot_slack(self.running, slo_tpot_s, time.monotonic())

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + self.kv_transfers.num_receiving,
            num_paused=len(self.paused),
            kv_cache_usage=self.kv_cache_manager.usage, num_preemptions=self.num_preemptions,
            prefix_cache_requests=prefix.requests, prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self, max_prefill_tokens: int | None = None) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their blocks.

        `max_prefill_tokens` caps the tokens of the step's chunks of more than one token
        (prompts, recomputes after a preemption) beside the decodes (one token each, never
        capped): `slo_budget.PrefillBudget.cap`. None: only the token budget bounds them.

        NOTE: there is no prefill or decode phase. Each request has
        `num_computed_tokens` and `num_tokens` (prompt + output); each step gives it
        `num_tokens - num_computed_tokens` more (one for a decode, a chunk of the prompt
        for a prefill, prompt + output after a preemption), as far as the token budget
        `max_num_batched_tokens` allows. Running requests go first, in admission order;
        then waiting ones in `_admission_order()` (shortest first by default), while fewer
        than `max_num_seqs` run. When a running request needs a block and none is free,
        the newest running request is preempted (recompute) until it fits; no waiting
        request is admitted in such a step.

        NOTE: blocks are cached when allocated (`KVCacheManager.allocate_slots`), so a
        request admitted in the same step as another with the same prefix already hits
        (and counts in `num_cached_tokens`) the blocks that one computes this step.

        NOTE: `request.num_computed_tokens` advances here, by `num_scheduled_tokens`: the
        KV of those tokens is written by this step's forward. `update_from_output()` only
        appends sampled tokens.
        """
        config = self.scheduler_config
        kv = self.kv_cache_manager
        self.update_from_kv_xfer_finished()
        batch = StepBatch(config, kv, max_prefill_tokens)
        preempted_ids: list[str] = []

        longrope = self.longrope_original
        i = 0
        while i < len(self.running) and batch.token_budget > 0:
            request = self.running[i]
            if longrope is not None:
                switch_to_long_rope(request, longrope, kv)
            num_new_tokens = batch.fit(request, request.num_computed_tokens)
            if num_new_tokens == 0:
                i += 1  # a prompt chunk, and this step's prefill budget is spent
                continue
            num_spec = num_spec_tokens(request, num_new_tokens, batch.token_budget, longrope)
            while (new_blocks := kv.allocate_slots(request, num_new_tokens + num_spec)) is None:
                if num_spec:  # drop the drafts before preempting anyone
                    num_spec = 0
                    continue
                if self.preempt_paused():  # idle KV goes first
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break  # `request` itself was the newest left, and is preempted.
            batch.add(request, num_new_tokens, num_spec)
            i += 1

        admitted: list[Request] = []
        # NOTE: no ordering work on the (common) steps that cannot admit anyone.
        can_admit = (not preempted_ids and batch.token_budget > 0
                     and len(self.running) < config.max_num_seqs)
        for request in (self._admission_order() if can_admit else ()):
            if batch.token_budget <= 0 or len(self.running) >= config.max_num_seqs:
                break
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self.kv_transfers.allocate(request, bool(self.running),
                                                  self.preempt_paused):
                    break  # nobody overtakes the head of the admission order
                admitted.append(request)  # out of the queue, not running
                continue
            if longrope is not None:
                switch_to_long_rope(request, longrope, kv)
            hits, num_hit_tokens = [], 0
            # NOTE: prompt logprobs (MEAN, CLS pooling) need every position: no prefix-cache hits.
            if request.num_computed_tokens == 0 and \
                    request.sampling_params.prompt_logprobs is None and uses_prefix_hits(request):
                hits, num_hit_tokens = kv.get_computed_blocks(request)
                if self.kv_transfers.start_load(request, hits):  # the rest is on disk
                    admitted.append(request)
                    continue
            num_new_tokens = batch.fit(request, request.num_computed_tokens + num_hit_tokens)
            if num_new_tokens == 0:
                break  # this step's prefill budget is spent (the order stands)
            while (new_blocks := kv.allocate_slots(request, num_new_tokens, hits,
                                                   num_hit_tokens)) is None:
                if not self.preempt_paused():
                    break
            if new_blocks is None:
                break  # nobody overtakes the head of the admission order
            admitted.append(request)
            request.num_computed_tokens += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            if config.scheduling_policy == "priority":  # preemption pops the end
                bisect.insort(self.running, request, key=priority_key)
            else:
                self.running.append(request)
            batch.add(request, num_new_tokens)
        if admitted:
            if len(admitted) == 1 and self.waiting[0] is admitted[0]:
                self.waiting.popleft()
            else:
                taken = {id(r) for r in admitted}
                self.waiting = deque(r for r in self.waiting if id(r) not in taken)

        finished_ids, self._finished_req_ids = self._finished_req_ids, []
        paused_ids, self.paused.preempted_ids = self.paused.preempted_ids, []
        return batch.output(preempted_ids + paused_ids, finished_ids)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput,
    ) -> list[EngineCoreOutput]:
        """Record prompt logprobs, append sampled tokens, apply the stop rules, finish.

        Args:
            scheduler_output: the output of the preceding `schedule()`.
            model_runner_output: the step's results: samples for every scheduled request
                with `sample=True` (other entries are ignored), prompt logprobs.

        Returns:
            One delta per request that got a token, in scheduled order.

        Raises:
            ValueError: a request scheduled with `sample=True` got no token.
        """
        deltas = []
        any_finished = False
        for request_id, (first_pos, chunk) in model_runner_output.prompt_logprobs.items():
            if (target := self.requests.get(request_id)) is not None:  # else: aborted
                target.add_prompt_logprobs(first_pos, chunk)
        index = {request_id: i for i, request_id in enumerate(model_runner_output.req_ids)}
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if not scheduled.sample or request.is_finished:
                continue  # a prefill chunk, or aborted since schedule()
            if request.pooling_params is not None:  # prefill only: done, with its pooled state
                deltas.append(finish_pooling(  # FINISHED_STOPPED, no token
                    request, model_runner_output.pooler_output[request.request_id]))
                self._finish(request)
                any_finished = True
                continue
            i = index.get(request.request_id)
            if i is None:
                raise ValueError(f"no sampled token for request {request.request_id!r}")
            new_token_ids, new_logprobs, status, stop_reason = append_sampled_tokens(
                request, scheduled.spec_token_ids, model_runner_output.sampled_token_ids[i],
                model_runner_output.logprobs[i], self.kv_cache_manager,
                self.spec_decoding_stats, self.scheduler_config.max_model_len)
            if status is not None:
                request.status = status
                request.stop_reason = stop_reason
                self._finish(request)
                any_finished = True
            prompt_logprobs = None
            if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                request.prompt_logprobs_sent = True  # complete: handed out once, now
                prompt_logprobs = list(request.prompt_logprobs)
            deltas.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=new_token_ids,
                new_logprobs=new_logprobs, finish_reason=request.finish_reason,
                stop_reason=request.stop_reason, prompt_logprobs=prompt_logprobs,
                num_cached_tokens=max(
                    request.num_cached_tokens - request.num_external_computed_tokens, 0),
                kv_transfer_params=(request.kv_transfer_params if isinstance(
                    request.kv_transfer_params, HeldBlocks) else None)))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return deltas

    # -- helpers ----------------------------------------------------------------------------

    def _admission_order(self) -> list[Request]:
        """The waiting requests in admission order (`scheduling_policy.admission_order`)."""
        order = admission_order(self.waiting, self.scheduler_config)
        return order if self.lora_admission is None else self.lora_admission(order, self.running)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, keep the tokens, requeue at the front."""
        self._free_for_recompute(request)
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _free_for_recompute(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _finish(self, request: Request) -> None:
        del self.requests[request.request_id]
        self.paused.discard(request.request_id)
        self._finished_req_ids.append(request.request_id)
        self.kv_transfers.free_finished(request)
