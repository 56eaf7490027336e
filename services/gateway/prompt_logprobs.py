"""vLLM's `prompt_logprobs` request field: its validation and its response form.

The engine computes them (shared/engine/prompt_logprobs.py) and returns them with a choice's
first output; here they become vLLM's JSON: one entry per prompt token, the first null, then
{"<token id>": {"logprob", "rank", "decoded_token"}} holding the prompt token itself first,
then the `prompt_logprobs` most likely tokens (vLLM's `list[dict[int, Logprob] | None]`).
On /v1/completions each choice carries them; on /v1/chat/completions the response does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.services.gateway.errors import GatewayError, bad_request
from pdserve.services.gateway.output_processor import TokenLogprob
from pdserve.services.gateway.protocol import SamplingRequest
from pdserve.services.gateway.serving import clamp_logprob


def check_prompt_logprobs(req: SamplingRequest, max_logprobs: int) -> None:
    """vLLM's rules: in [0, max_logprobs] (-1, the whole vocabulary, only where vLLM's
    max_logprobs is -1, which pdserve's is not), and not with stream.

    Raises:
        GatewayError: 400 naming prompt_logprobs.
    """
    value = req.prompt_logprobs
    if value is None:
        return
    if not 0 <= value <= max_logprobs:
        raise bad_request(f"prompt_logprobs must be in [0, {max_logprobs}], got {value}",
                          "prompt_logprobs")
    if req.stream:
        raise bad_request("prompt_logprobs are not available when stream is true",
                          "prompt_logprobs")


def prompt_logprobs_json(prompt_token_ids: Sequence[int], logprobs: Sequence[TokenLogprob],
                         num_top: int, token_text: Callable[[int], str]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of one prompt.

    Args:
        logprobs: the engine's, one per prompt token after the first; their `top` lists may
            hold more than `num_top` entries (echo asked for more): the first `num_top` count.
        num_top: the request's prompt_logprobs.

    Raises:
        GatewayError: 503 when the engine did not return one per prompt token after the first.
    """
    if len(logprobs) != len(prompt_token_ids) - 1:
        raise GatewayError(f"the engine returned {len(logprobs)} prompt logprobs for a "
                           f"{len(prompt_token_ids)}-token prompt", 503)
    out: list[dict | None] = [None]
    for lp in logprobs:
        entry = {str(lp.token_id): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                                    "decoded_token": token_text(lp.token_id)}}
        for rank, (token_id, value) in enumerate(lp.top[:num_top], 1):
            entry.setdefault(str(token_id), {"logprob": clamp_logprob(value), "rank": rank,
                                             "decoded_token": token_text(token_id)})
        out.append(entry)
    return out
