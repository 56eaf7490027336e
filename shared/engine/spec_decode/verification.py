"""Scoring drafts in the batch and accepting them (the engine side of speculative decoding).

A request with drafts d_0..d_{k-1} is scheduled on k + 1 query tokens: its last token and
the drafts. Row j of its logits is the target distribution p_j of output position
num_output_tokens + j, given the drafts before it. Every row is sampled by the ordinary
sampler (greedy, temperature, top-k/p, min-p, seeds keyed by output position), giving
s_0..s_k; the request keeps

    s_0 .. s_a      a = the number of leading j with s_j == d_j   (accepted drafts + 1)

Greedy: s_j is the argmax, so this is "longest matching prefix, plus the bonus token".
Temperature > 0: for one-hot drafts (n-gram) this IS vLLM's rejection sampling: d_j is
accepted with probability P(s_j == d_j) = p_j(d_j), and on rejection the kept s_j is
distributed as p_j conditioned on s_j != d_j, i.e. p_j with d_j zeroed and renormalised
(the residual). After a rejection nothing later is kept, as there. Because s_j is drawn
exactly as speculation-off would draw it, a seeded request's output does not change with
speculation at all (its draws are keyed by (seed, output position)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pdserve.shared.request import Request, TokenLogprobs
from pdserve.shared.stop_rules import num_tokens_left


def num_accepted_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """a: the number of leading drafts equal to the target's samples (len(sampled) =
    len(drafts) + 1); the request keeps sampled[:a + 1]."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


def can_speculate(request: Request) -> bool:
    """Drafts are scored only for plain requests: no grammar, no penalties or bad words
    (they would need the drafts in their token history) and no prompt logprobs."""
    sp = request.sampling_params
    return (request.structured_output is None and not sp.has_penalties
            and sp.prompt_logprobs is None and not sp.bad_words_token_ids)


def max_num_drafts(request: Request, max_model_len: int) -> int:
    """Drafts that may follow `request`'s tokens: its accepted drafts plus the bonus token
    stay within max_tokens and max_model_len (so the scheduler's admission bound on KV
    slots, `max_num_tokens - 1`, still holds)."""
    return max(0, num_tokens_left(request.sampling_params, max_model_len,
                                  request.num_prompt_tokens, request.num_output_tokens) - 1)


class DraftRows(NamedTuple):
    """The logits rows of a step with drafts: one per sampled position."""

    requests: list[Request]
    """Per row, its request (a request with k drafts has k + 1 consecutive rows)."""
    output_offsets: list[int]
    """Per row, j: it samples output position num_output_tokens + j."""
    num_rows: list[int]
    """Per sampling request, in order: its number of rows (1 + its drafts)."""


def expand_draft_rows(scheduled: list, sampled: list[int], query_start_loc: np.ndarray
                      ) -> tuple[np.ndarray, DraftRows]:
    """[num_rows] int64 logits indices (batch rows of every scored position) and the rows.

    `sampled`: indices into `scheduled` of the rows that sample, in order.
    """
    indices: list[int] = []
    requests: list[Request] = []
    offsets: list[int] = []
    num_rows: list[int] = []
    for i in sampled:
        s = scheduled[i]
        n = 1 + len(s.spec_token_ids)
        end = int(query_start_loc[i + 1])
        indices.extend(range(end - n, end))
        requests.extend([s.request] * n)
        offsets.extend(range(n))
        num_rows.append(n)
    return np.asarray(indices, dtype=np.int64), DraftRows(requests, offsets, num_rows)


def group_draft_samples(rows: DraftRows, token_ids: list[int],
                        logprobs: list[TokenLogprobs | None]
                        ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
    """The per-row samples grouped per request (`ModelRunnerOutput.sampled_token_ids` and
    `.logprobs`): 1 + k entries for a request with k drafts, all its samples (the
    scheduler keeps the accepted ones)."""
    grouped_ids: list[list[int]] = []
    grouped_logprobs: list[list[TokenLogprobs | None]] = []
    row = 0
    for n in rows.num_rows:
        grouped_ids.append(token_ids[row:row + n])
        grouped_logprobs.append(logprobs[row:row + n])
        row += n
    return grouped_ids, grouped_logprobs


@dataclass(slots=True)
class SpecDecodingStats:
    """Cumulative counters (vLLM's spec-decode metrics)."""

    num_drafts: int = 0
    """Steps in which a request was scored with at least one draft."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """Index j: drafts accepted at draft position j."""

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1
