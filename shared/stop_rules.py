"""When a request stops: the stop and length rules, in one place (torch-free).

    check_stop(request, max_model_len)   the scheduler, after each output token
    check_stop_token(params, token_id, num_output_tokens, eos_token_id)
                                         a stop token and its stop_reason (also the gateway's)
    at_length_limit(params, max_model_len, num_prompt_tokens, num_output_tokens)
                                         the length caps (also the prefill's and the gateway's)

The rules, in order of precedence (vLLM v1's `check_stop`, vllm/v1/core/sched/utils.py):

1. A stop token ends the request once it has min_tokens output tokens: EOS unless
   ignore_eos (stop_reason None), or a stop_token_ids entry (stop_reason: that entry).
2. A guided request ends when its grammar is done (stop_reason None).
3. Otherwise it is capped at max_tokens output tokens, or max_model_len tokens in all.

`params` is a SamplingParams or its proto (shared/proto/engine.proto, where max_tokens 0
means no cap). Stop strings match detokenized text, which only the gateway has: they live in
services/gateway/stop_checker.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.request import RequestStatus

if TYPE_CHECKING:
    from shared.proto.engine_pb2 import SamplingParams as ProtoSamplingParams
    from shared.request import Request
    from shared.sampling_params import SamplingParams


def check_stop_token(params: SamplingParams | ProtoSamplingParams, token_id: int,
                     num_output_tokens: int, eos_token_id: int | None
                     ) -> tuple[bool, int | None]:
    """Rule 1: (whether `token_id`, a request's `num_output_tokens`-th output token, ends it,
    stop_reason). `eos_token_id` None: EOS unknown (the gateway), only stop_token_ids count."""
    if num_output_tokens < params.min_tokens:
        return False, None
    if token_id == eos_token_id and not params.ignore_eos:
        return True, None
    if token_id in params.stop_token_ids:
        return True, token_id
    return False, None


def at_length_limit(params: SamplingParams | ProtoSamplingParams, max_model_len: int,
                    num_prompt_tokens: int, num_output_tokens: int) -> bool:
    """Rule 3: max_tokens output tokens reached (None or 0: no cap), or max_model_len tokens
    in all (the engine would refuse to go on)."""
    return (bool(params.max_tokens) and num_output_tokens >= params.max_tokens) or \
        num_prompt_tokens + num_output_tokens >= max_model_len


def check_stop(request: Request, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
    """Whether `request` is done after its last output token: (status, stop_reason), by
    rules 1-3; (None, None) when it goes on."""
    params = request.sampling_params
    stopped, stop_reason = check_stop_token(params, request.output_token_ids[-1],
                                            request.num_output_tokens, request.eos_token_id)
    if stopped or (request.structured_output is not None
                   and request.structured_output.is_terminated):
        return RequestStatus.FINISHED_STOPPED, stop_reason
    if at_length_limit(params, max_model_len, request.num_prompt_tokens,
                       request.num_output_tokens):
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    return None, None
