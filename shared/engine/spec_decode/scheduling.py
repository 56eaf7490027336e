"""The scheduler's and engine core's side of speculative decoding: how many drafts a
request is scored on, what is kept of its samples, and when drafts are proposed.

KV of a step with drafts (T = request.num_tokens before the step, k drafts, a accepted):

    positions  ... T-1 | T   ...  T+a-1 | T+a ... T+k-1
               last    | accepted drafts | rejected drafts
    KV written by the step: all of them; num_computed_tokens: T+k at schedule(),
    rolled back to T+a (= num_tokens - 1 after the a + 1 kept tokens) at update.

The rejected positions' slots are simply rewritten when those positions are computed
again; blocks past the computed ones are freed (`KVCacheManager.trim_blocks`). Blocks are
cached only when full of known tokens, and drafts are never known tokens until accepted,
so a rejected draft never reaches the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.shared.engine.spec_decode.config import SpeculativeConfig
from pdserve.shared.engine.spec_decode.ngram_proposer import NgramProposer
from pdserve.shared.engine.spec_decode.verification import (
    SpecDecodingStats,
    can_speculate,
    max_num_drafts,
    num_accepted_drafts,
)
from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.request import Request, RequestStatus, TokenLogprobs
from pdserve.shared.stop_rules import check_stop


def num_spec_tokens(request: Request, num_new_tokens: int, token_budget: int,
                    longrope_original: int | None = None) -> int:
    """Drafts to score with `request` this step: its proposals, when it is decoding (one
    token to compute) and the token budget has room after that token. A longrope request
    still short scores no position from `longrope_original` on (shared/engine/longrope.py:
    its logits there are the long factors', after a recompute)."""
    drafts = request.spec_token_ids
    if not drafts or num_new_tokens != 1 or \
            request.num_computed_tokens != request.num_tokens - 1:
        return 0
    if longrope_original is not None and not request.rope_long:
        token_budget = min(token_budget, longrope_original - request.num_tokens + 1)
    return max(0, min(len(drafts), token_budget - 1))


def append_sampled_tokens(request: Request, drafts: Sequence[int], token_ids: list[int],
                          logprobs: list[TokenLogprobs | None],
                          kv_cache_manager: KVCacheManager, stats: SpecDecodingStats,
                          max_model_len: int
                          ) -> tuple[list[int], list[TokenLogprobs], RequestStatus | None,
                                     int | None]:
    """Keep the accepted drafts and the token after them, one at a time under the stop
    rules (nothing past a stop is kept), roll the rejected drafts' KV back. Without drafts
    (k = 0): append the one sample, apply the stop rules.

    Args:
        token_ids: the k + 1 samples of a request scored with its k `drafts` (its
            `ModelRunnerOutput.sampled_token_ids`); `logprobs`: theirs, or Nones.

    Returns:
        (kept token ids, their logprobs (those not None), status, stop_reason) where
        status / stop_reason are `check_stop`'s after the last kept token.
    """
    num_accepted = num_accepted_drafts(drafts, token_ids)
    if drafts:
        stats.observe(len(drafts), num_accepted)
    request.num_computed_tokens -= len(drafts) - num_accepted
    kept: list[int] = []
    kept_logprobs: list[TokenLogprobs] = []
    status, stop_reason = None, None
    for token_id, lp in zip(token_ids[:num_accepted + 1], logprobs):
        request.append_output_token(token_id, lp)
        kept.append(token_id)
        if lp is not None:
            kept_logprobs.append(lp)
        status, stop_reason = check_stop(request, max_model_len)
        if status is not None:
            break
    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
    kv_cache_manager.trim_blocks(request, request.num_computed_tokens)
    return kept, kept_logprobs, status, stop_reason


class Proposer(Protocol):
    """What the engine core asks of a proposer (n-gram, draft model)."""

    def propose_requests(self, requests: list[Request], max_num_drafts: list[int]
                         ) -> list[list[int]]:
        """Per request, up to min(k, its max_num_drafts) drafts to follow its tokens."""
        ...

    def remove_requests(self, request_ids: list[str]) -> None:
        """Forget finished, aborted or preempted requests (free their draft state)."""
        ...


def make_proposer(config: SpeculativeConfig, model_config, model_runner) -> Proposer:
    """The proposer `config.method` names; a draft model is loaded beside the target's
    `model_runner` (its device, dtype, block size and attention backend).

    Raises:
        ValueError: a draft model whose vocabulary differs from the target's.
    """
    if config.method == "draft_model":
        from pdserve.shared.engine.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, model_config, model_runner)
    return NgramProposer(config)


def propose_drafts(proposer: Proposer, config: SpeculativeConfig,
                   running: list[Request], max_model_len: int) -> None:
    """Set each running request's `spec_token_ids` for the next step (after a step's
    update). Backs off under load: no drafts while more than `disable_by_batch_size`
    requests run."""
    backoff = config.disable_by_batch_size
    propose = backoff == 0 or len(running) <= backoff
    requests: list[Request] = []
    for request in running:
        if not propose or request.num_computed_tokens != request.num_tokens - 1 \
                or not can_speculate(request):
            if request.spec_token_ids:
                request.spec_token_ids = []
            continue
        requests.append(request)
    if not requests:
        return
    limits = [max_num_drafts(r, max_model_len) for r in requests]
    for request, drafts in zip(requests, proposer.propose_requests(requests, limits)):
        request.spec_token_ids = drafts
