"""When a request stops, in one place (torch-free: the gateway imports it). vLLM v1's order
(vllm/v1/core/sched/utils.py): a stop token once min_tokens are out (EOS unless ignore_eos:
stop_reason None; a stop_token_ids entry: stop_reason that id), a guided request's finished
grammar, then the caps: max_tokens output tokens, max_model_len tokens in all. `params`: a
`StopParams`, a SamplingParams or its proto (max_tokens None or 0: no cap). Stop strings need
the text, which only the gateway has: services/gateway/stop_checker.py."""

from __future__ import annotations

from collections.abc import Container
from typing import Protocol

from pdserve.shared.request import Request, RequestStatus


class StopParams(Protocol):
    """What the stop rules read of a request's sampling parameters: `SamplingParams` has it,
    and so has its proto (`engine_pb2.SamplingParams`, max_tokens 0 for no cap), which the
    gateway's failover checks between attempts."""

    @property
    def min_tokens(self) -> int: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def stop_token_ids(self) -> Container[int]: ...
    @property
    def max_tokens(self) -> int | None: ...


def check_stop_token(params: StopParams, token_id: int, num_output_tokens: int,
                     eos_token_id: int | None) -> tuple[bool, int | None]:
    """(whether `token_id`, the `num_output_tokens`-th output token, stops the request,
    stop_reason). `eos_token_id` None: EOS unknown (the gateway), stop_token_ids only."""
    if num_output_tokens < params.min_tokens:
        return False, None
    if token_id == eos_token_id and not params.ignore_eos:
        return True, None
    if token_id in params.stop_token_ids:
        return True, token_id
    return False, None


def num_tokens_left(params: StopParams, max_model_len: int, num_prompt_tokens: int,
                    num_output_tokens: int) -> int:
    """Output tokens the request may still produce before a cap; <= 0: capped."""
    left = max_model_len - num_prompt_tokens - num_output_tokens
    return min(left, params.max_tokens - num_output_tokens) if params.max_tokens else left


def at_length_limit(params: StopParams, max_model_len: int, num_prompt_tokens: int,
                    num_output_tokens: int) -> bool:
    """Whether a cap is reached: the engine would refuse to go on."""
    return num_tokens_left(params, max_model_len, num_prompt_tokens, num_output_tokens) <= 0


def check_stop(request: Request, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
    """(status, stop_reason) of `request` after its last output token; (None, None): go on."""
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
