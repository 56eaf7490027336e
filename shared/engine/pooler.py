"""Pooler: a pooling request's hidden states -> its embedding (vLLM's LAST / MEAN / CLS
pooling with optional L2 normalisation), step by step over chunked prefill.

The model's forward returns hidden states before the final norm; pooling reads them after
it, as transformers' `last_hidden_state` of the base model (`model.norm` per token, then
pooled):

    chunk [start, start + n) of a pooling request, rows [a, a + n) of the step's batch
      CLS   start == 0: keep row a                              (first prompt token)
      MEAN  add rows a .. a+n-1 to the running sum (reset at start == 0: a recompute)
      LAST  the chunk that reaches the prompt's end: keep row a+n-1
    last chunk: MEAN divides by the prompt length; normalize: x / max(||x||_2, 1e-12)

The model runner keeps the state between chunks (`partial`, by request id) and returns the
pooled vector (fp32, on the CPU) in its output (`ModelRunnerOutput.pooler_output`): the
scheduler hands it out when it finishes the request (shared/pooling_params.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def has_pooling(scheduled: Sequence) -> bool:
    return any(s.request.pooling_params is not None for s in scheduled)


def pool_step(norm: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
              scheduled: Sequence, partial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Advance the pooling state of every pooling request of this step; returns request_id
    -> the pooled vector ([hidden_size] fp32, CPU) of those whose prompt it completes.

    Args:
        norm: the model's final norm ([rows, hidden] -> [rows, hidden]).
        hidden: [num_tokens, hidden_size] the step's hidden states before the final norm, in
            the scheduled order (`ScheduledRequest`s, each `num_scheduled_tokens` rows).
        scheduled: the step's ScheduledRequests.
        partial: request_id -> its state between chunks (CLS row, MEAN running sum),
            updated in place; a request's entry leaves when its vector is returned.
    """
    pooled_out: dict[str, torch.Tensor] = {}
    start_row = 0
    for s in scheduled:
        rows = slice(start_row, start_row + s.num_scheduled_tokens)
        start_row = rows.stop
        request_id, params = s.request.request_id, s.request.pooling_params
        if params is None:
            continue
        kind = params.pooling_type
        if kind == "CLS":
            if s.start_pos == 0:
                partial[request_id] = norm(hidden[rows.start:rows.start + 1])[0].float()
        elif kind == "MEAN":
            chunk_sum = norm(hidden[rows]).float().sum(dim=0)
            partial[request_id] = chunk_sum if s.start_pos == 0 or request_id not in partial \
                else partial[request_id] + chunk_sum
        elif s.sample:  # LAST: only the row of the prompt's last token
            partial[request_id] = norm(hidden[rows.stop - 1:rows.stop])[0].float()
        if not s.sample:
            continue
        pooled = partial.pop(request_id)
        if kind == "MEAN":
            pooled = pooled / s.request.num_prompt_tokens
        if params.normalize:
            pooled = F.normalize(pooled, p=2, dim=0)
        pooled_out[request_id] = pooled.cpu()
    return pooled_out
