"""What the Scheduler hands to the model runner, and what it hands back to the worker."""

from __future__ import annotations

from typing import Any, NamedTuple

from pdserve.shared.kv_transfer.params import HeldBlocks
from pdserve.shared.request import FinishReason, Request, TokenLogprobs


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
