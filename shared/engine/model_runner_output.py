"""ModelRunnerOutput: one model-runner step's results, one record (vLLM's v1 `outputs.py`).

Torch-free (a pooled vector aside): the scheduler applies it to the requests it owns
(`update_from_output`); the runner never writes into a `Request`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pdserve.shared.request import TokenLogprobs

if TYPE_CHECKING:
    import torch


class PromptLogprobs(NamedTuple):
    """The prompt logprobs one step computed for one request (shared/engine/prompt_logprobs.py)."""

    first_pos: int
    """`logprobs[j]` is the entry of prompt token first_pos + 1 + j (its logprob given the
    tokens before it)."""
    logprobs: list[TokenLogprobs]
    """Possibly empty: a step that starts a one-token prompt, whose only entry is None."""


class ModelRunnerOutput(NamedTuple):
    """What `ModelRunner.execute_model` returns: the same shape with and without
    speculative decoding (a request scored with k drafts simply has k + 1 samples)."""

    req_ids: list[str]
    """The requests that sampled this step, in batch order (pooling requests sample
    nothing)."""
    sampled_token_ids: list[list[int]]
    """Per request of `req_ids`: one token, or k + 1 for one scored with k drafts (all the
    samples; the scheduler keeps the accepted drafts and the token after them)."""
    logprobs: list[list[TokenLogprobs | None]]
    """Per request, one entry per sampled token: None where it asked for no logprobs."""
    prompt_logprobs: dict[str, PromptLogprobs]
    """request_id -> the prompt positions' logprobs computed this step (requests that ask
    for them, until they are handed out)."""
    pooler_output: dict[str, torch.Tensor]
    """request_id -> the pooled vector ([hidden_size] fp32, CPU) of each pooling request
    whose prompt this step completes (shared/engine/pooler.py)."""


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput([], [], [], {}, {})
