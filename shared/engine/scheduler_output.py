"""What the Scheduler hands to the model runner (built by `StepBatch`), what it hands back
to the worker, and its read-only views (`Scheduler.request_views`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from pdserve.shared.config import SchedulerConfig
from pdserve.shared.kv_transfer.params import HeldBlocks
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.request import FinishReason, Request, RequestStatus, TokenLogprobs

if TYPE_CHECKING:
    from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager


class ScheduledRequest(NamedTuple):
    """One request's share of a step: tokens [start_pos, start_pos + num_scheduled_tokens)."""

    request: Request
    start_pos: int
    """request.num_computed_tokens before this step: the position of the first new token."""
    num_scheduled_tokens: int
    """Tokens whose KV this step computes (a decode step: 1; a prefill chunk: more)."""
    block_ids: list[int]
    """All of the request's physical block ids in logical order, covering at least
    start_pos + num_scheduled_tokens tokens (a copy, the runner may keep it)."""
    sample: bool
    """This chunk reaches the last known token, so a token is sampled from its last row."""
    spec_token_ids: tuple[int, ...] = ()
    """Draft tokens scored after the last known token (speculative decoding); they count
    in num_scheduled_tokens, and sample=True: every one of their rows is sampled."""


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    """Decodes first (one token, sample=True), then prefill chunks; within each group,
    running requests in admission order, then newly admitted ones."""
    total_num_scheduled_tokens: int
    """sum(s.num_scheduled_tokens for s in scheduled) <= max_num_batched_tokens."""
    preempted_request_ids: list[str]
    """Requests preempted by this step (blocks freed; they will recompute from token 0)."""
    finished_request_ids: list[str]
    """Requests that finished or were aborted since the previous schedule(): the runner
    may drop any per-request state it keeps for them."""


class StepBatch:
    """One step's batch as `Scheduler.schedule()` builds it (mini-sglang's PrefillAdder):
    the token budget left (`max_num_batched_tokens`), the prefill budget left (the tokens
    of chunks of more than one token: `max_prefill_tokens`, else the token budget), and
    the requests' shares so far."""

    __slots__ = ("config", "kv", "token_budget", "prefill_budget", "scheduled")

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 max_prefill_tokens: int | None):
        self.config = config
        self.kv = kv
        self.token_budget = config.max_num_batched_tokens
        self.prefill_budget = self.token_budget if max_prefill_tokens is None \
            else max_prefill_tokens
        self.scheduled: list[ScheduledRequest] = []

    def fit(self, request: Request, num_computed_tokens: int) -> int:
        """The tokens `request` computes this step past `num_computed_tokens`: the rest of
        its known tokens, at most `long_prefill_token_threshold` (when > 0) and the token
        budget left; a chunk of more than one token at most the prefill budget left (0: it
        is spent), and debited from it here (a caller that then cannot schedule them ends
        the step's pass: the prefill budget is not read again)."""
        num_new_tokens = request.num_tokens - num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new_tokens = min(num_new_tokens, threshold)
        num_new_tokens = min(num_new_tokens, self.token_budget)
        if num_new_tokens > 1:
            num_new_tokens = min(num_new_tokens, self.prefill_budget)
            self.prefill_budget -= num_new_tokens
        return num_new_tokens

    def add(self, request: Request, num_new_tokens: int, num_spec: int = 0) -> None:
        """Schedule `num_new_tokens` known tokens of `request` plus `num_spec` of its drafts
        (the rest dropped): advances `request.num_computed_tokens` past them all and takes
        them from the token budget. Its blocks must already cover them."""
        start_pos = request.num_computed_tokens
        request.num_computed_tokens = start_pos + num_new_tokens + num_spec
        spec = tuple(request.spec_token_ids[:num_spec]) if num_spec else ()
        if request.spec_token_ids:
            request.spec_token_ids = []  # consumed (or stale): the proposer sets new ones
        self.scheduled.append(ScheduledRequest(
            request=request, start_pos=start_pos,
            num_scheduled_tokens=num_new_tokens + num_spec,
            block_ids=self.kv.get_block_ids(request.request_id),
            sample=start_pos + num_new_tokens == request.num_tokens, spec_token_ids=spec))
        self.token_budget -= num_new_tokens + num_spec

    def output(self, preempted_request_ids: list[str],
               finished_request_ids: list[str]) -> SchedulerOutput:
        """The step's SchedulerOutput, decodes first: the model runner batches the leading
        single-token rows together."""
        scheduled = self.scheduled
        decodes = [s for s in scheduled if s.num_scheduled_tokens == 1 and s.sample]
        if len(decodes) != len(scheduled):
            scheduled = decodes + [s for s in scheduled
                                   if not (s.num_scheduled_tokens == 1 and s.sample)]
        return SchedulerOutput(scheduled, self.config.max_num_batched_tokens - self.token_budget,
                               preempted_request_ids, finished_request_ids)


class EngineCoreOutput(NamedTuple):
    """What one step added to one request: the one output type from the engine core to
    its callers (the offline `LLM`, `AsyncEngine`, the prefill and decode services), as
    vLLM v1's `EngineCoreOutput`."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    """Empty when the runner gave no logprobs."""
    finish_reason: FinishReason | None
    """None while the request goes on."""
    stop_reason: int | None
    """The stop_token_ids entry that ended it; None otherwise (EOS included, as in vLLM)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On the first output of a request asking for prompt logprobs: one per prompt token,
    the first None (see shared/engine/prompt_logprobs.py)."""
    num_cached_tokens: int = 0
    """Tokens found in this instance's prefix cache (a received request: those it did not
    fetch), as of its first admission."""
    kv_transfer_params: HeldBlocks | None = None
    """On a prefill's last output, when the scheduler holds its blocks for the decode side
    (`KVConnector.request_finished`): their hashes, from which the prefill service builds the
    `KVHandle` it answers with. None otherwise."""
    pooled: Any = None
    """A finished pooling request's pooled hidden state ([hidden_size] float32 tensor on
    the CPU, normalised if asked); None for a generate request."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(NamedTuple):
    """A snapshot for metrics; the counters are cumulative since start-up."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_requests: int
    prefix_cache_queries: int
    """Tokens looked up in the prefix cache, one count per admission."""
    prefix_cache_hits: int
    """Tokens found there."""
    num_paused: int = 0
    """Requests paused by backpressure (`Scheduler.pause_requests`)."""


class RequestView(NamedTuple):
    """One request the scheduler holds, as of the call (a snapshot: nothing in it changes
    with the request)."""

    request_id: str
    status: RequestStatus
    """Unfinished (PAUSED included), or finished and held for a transfer (`kv_transfer`)."""
    kv_transfer: str
    """"send": finished, its blocks held for a decode instance to fetch; "receive": its
    blocks held while a receive writes them (WAITING_FOR_REMOTE_KVS, or aborted meanwhile);
    "": neither."""
    block_ids: tuple[int, ...]
    """Its physical block ids in logical order (0: the null block, out of a window)."""
    num_cached_tokens: int
    """-1 until its first admission (`Request.num_cached_tokens`)."""
    num_computed_tokens: int
    num_prompt_tokens: int
    num_tokens: int
    lora_request: LoRARequest | None

    @classmethod
    def of(cls, request: Request, kv: KVCacheManager, kv_transfer: str = "") -> RequestView:
        return cls(request.request_id, request.status, kv_transfer,
                   tuple(kv.get_block_ids(request.request_id)), request.num_cached_tokens,
                   request.num_computed_tokens, request.num_prompt_tokens, request.num_tokens,
                   request.lora_request)
