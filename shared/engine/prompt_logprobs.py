"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): for every prompt token after the
first, its log-probability given the tokens before it, plus the `k` most likely tokens there.

Computed by the model runner in the steps that compute the prompt's KV: for a request that
asks for them, the hidden state of every scheduled prompt position `p < num_prompt_tokens - 1`
goes through the LM head, `log_softmax` in fp32 over the raw logits (no temperature,
penalties or truncation, as vLLM v1's default logprobs mode), and the entry of token
`prompt[p + 1]` is gathered. The runner returns them (`ModelRunnerOutput.prompt_logprobs`);
the scheduler's `update_from_output` writes them into `request.prompt_logprobs[p + 1]`
(created at the step that starts the prompt at position 0); entry 0 stays None (the first
token has no context). Chunked prefill fills the list chunk by chunk; a recompute after a
preemption before they were handed out overwrites entries with the same values; after, it
computes none.

NOTE: prompt positions served from the prefix cache have no logits, so a request asking for
prompt logprobs skips the prefix-cache lookup and computes its whole prompt (as vLLM v1
does); the blocks it computes are still cached for other requests. The scheduler hands the
list out once, with the request's first output (`EngineCoreOutput.prompt_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdserve.shared.engine.model_runner_output import PromptLogprobs
from pdserve.shared.request import Request, TokenLogprobs

ROWS_PER_CHUNK = 256
"""Positions sent through the LM head at once: bounds the fp32 [rows, vocab] logits tensor
(256 x 49,152 x 4 B = 48 MiB for SmolLM2)."""


class PromptLogprobsJob(NamedTuple):
    """One request's prompt positions whose logprobs this step computes."""

    request: Request
    first_row: int
    """Row of the batch's hidden states holding position `first_pos`."""
    first_pos: int
    num_positions: int


def plan_prompt_logprobs(scheduled: Sequence, query_start_loc: Sequence[int]
                         ) -> list[PromptLogprobsJob]:
    """The jobs of one step: for each scheduled request with `prompt_logprobs` set, the
    scheduled positions in [start_pos, num_prompt_tokens - 1). Reads the requests only.

    A request gets jobs from the step that starts its computation at position 0 on (that
    job is planned even with no position, a one-token prompt: its list is created then); a
    request whose prompt KV came from elsewhere (a KV transfer) gets none.

    Args:
        scheduled: the step's `ScheduledRequest`s, in batch order.
        query_start_loc: [len(scheduled) + 1] the first batch row of each request.
    """
    jobs = []
    for i, s in enumerate(scheduled):
        request = s.request
        if request.sampling_params.prompt_logprobs is None or request.prompt_logprobs_sent:
            continue  # not asked for, or handed out already (a recompute after preemption)
        if s.start_pos != 0 and request.prompt_logprobs is None:
            continue  # its prompt was not computed here from position 0
        end = min(s.start_pos + s.num_scheduled_tokens, request.num_prompt_tokens - 1)
        if end > s.start_pos or s.start_pos == 0:
            jobs.append(PromptLogprobsJob(request, int(query_start_loc[i]), s.start_pos,
                                          max(end - s.start_pos, 0)))
    return jobs


def compute_prompt_logprobs(compute_logits, hidden: torch.Tensor,
                            jobs: Sequence[PromptLogprobsJob]) -> dict[str, PromptLogprobs]:
    """request_id -> the logprobs of each job's positions (engine thread, inference mode).

    Args:
        compute_logits: [rows, hidden_size] -> [rows, vocab_size] float32 raw logits.
        hidden: [num_batch_tokens, hidden_size] the step's final hidden states (before the
            final norm, as `compute_logits` takes them).
    """
    results: dict[str, PromptLogprobs] = {}
    for job in jobs:
        request = job.request
        k = request.sampling_params.prompt_logprobs or 0
        out: list[TokenLogprobs] = []
        results[request.request_id] = PromptLogprobs(job.first_pos, out)
        target_ids = request.prompt_token_ids[job.first_pos + 1:
                                              job.first_pos + 1 + job.num_positions]
        targets = torch.tensor(target_ids, dtype=torch.int64, device=hidden.device)
        for off in range(0, job.num_positions, ROWS_PER_CHUNK):
            n = min(ROWS_PER_CHUNK, job.num_positions - off)
            rows = hidden[job.first_row + off:job.first_row + off + n]
            logprobs = torch.log_softmax(compute_logits(rows), dim=-1, dtype=torch.float32)
            chosen_t = logprobs.gather(1, targets[off:off + n, None])
            ranks = (logprobs >= chosen_t).sum(dim=-1).tolist()
            chosen = chosen_t.squeeze(1).tolist()
            if k:
                top_values, top_ids = logprobs.topk(k, dim=-1)
                values, ids = top_values.tolist(), top_ids.tolist()
            else:
                values = ids = [[] for _ in range(n)]
            out.extend(TokenLogprobs(target_ids[off + j], chosen[j], ids[j], values[j], ranks[j])
                       for j in range(n))
    return results
