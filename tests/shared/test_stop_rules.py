"""shared/stop_rules.py: every stop and length rule, on a Request and on the proto params."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.services.proto import engine_pb2
from pdserve.shared.request import Request, RequestStatus
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.stop_rules import at_length_limit, check_stop, check_stop_token, num_tokens_left

EOS, STOP_ID, OTHER = 2, 7, 9
STOPPED, CAPPED = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED


def _request(outputs, grammar_done=None, num_prompt=3, **params) -> Request:
    r = Request("r", list(range(10, 10 + num_prompt)), SamplingParams(**params),
                eos_token_id=EOS)
    r.output_token_ids = list(outputs)
    if grammar_done is not None:
        r.structured_output = SimpleNamespace(is_terminated=grammar_done)
    return r


@pytest.mark.parametrize("outputs, kwargs, max_model_len, expected", [
    ([OTHER, EOS], {}, 100, (STOPPED, None)),
    ([OTHER, EOS], {"ignore_eos": True}, 100, (None, None)),
    ([OTHER, STOP_ID], {"stop_token_ids": [STOP_ID]}, 100, (STOPPED, STOP_ID)),
    # EOS first: listed in stop_token_ids too, it still reports None (vLLM) ...
    ([EOS], {"stop_token_ids": [EOS]}, 100, (STOPPED, None)),
    # ... unless ignore_eos, when only the stop_token_ids entry stops it.
    ([EOS], {"stop_token_ids": [EOS], "ignore_eos": True}, 100, (STOPPED, EOS)),
    # min_tokens: the 2nd output token may not stop a request of min_tokens 3 ...
    ([OTHER, EOS], {"min_tokens": 3}, 100, (None, None)),
    ([OTHER, STOP_ID], {"stop_token_ids": [STOP_ID], "min_tokens": 3}, 100, (None, None)),
    ([OTHER, OTHER, STOP_ID], {"stop_token_ids": [STOP_ID], "min_tokens": 3}, 100,
     (STOPPED, STOP_ID)),
    # ... but the length caps still end it.
    ([OTHER, EOS], {"min_tokens": 3}, 5, (CAPPED, None)),
    ([OTHER, EOS], {"min_tokens": 2, "max_tokens": 2}, 100, (STOPPED, None)),
    ([OTHER, OTHER], {"max_tokens": 2}, 100, (CAPPED, None)),
    ([OTHER], {"max_tokens": 2}, 100, (None, None)),
    ([OTHER, OTHER], {"max_tokens": None}, 5, (CAPPED, None)),  # 3 prompt + 2 = 5
    ([OTHER], {"max_tokens": None}, 5, (None, None)),
    # A stop token takes precedence over both caps.
    ([OTHER, STOP_ID], {"stop_token_ids": [STOP_ID], "max_tokens": 2}, 5, (STOPPED, STOP_ID)),
])
def test_check_stop(outputs, kwargs, max_model_len, expected):
    assert check_stop(_request(outputs, **kwargs), max_model_len) == expected


@pytest.mark.parametrize("grammar_done, kwargs, expected", [
    (True, {}, (STOPPED, None)),
    (True, {"min_tokens": 5}, (STOPPED, None)),  # min_tokens does not hold a done grammar
    (True, {"stop_token_ids": [OTHER]}, (STOPPED, OTHER)),  # the stop token's reason wins
    (False, {"max_tokens": 1}, (CAPPED, None)),
    (False, {}, (None, None)),
])
def test_check_stop_guided(grammar_done, kwargs, expected):
    assert check_stop(_request([OTHER], grammar_done, **kwargs), 100) == expected


def test_gateway_proto_params_and_unknown_eos():
    params = engine_pb2.SamplingParams(max_tokens=0, min_tokens=2, stop_token_ids=[STOP_ID])
    assert not at_length_limit(params, 100, 10, 89)  # proto max_tokens 0: no cap
    assert at_length_limit(params, 100, 10, 90)  # max_model_len
    assert at_length_limit(engine_pb2.SamplingParams(max_tokens=4), 100, 10, 4)
    assert not at_length_limit(engine_pb2.SamplingParams(max_tokens=4), 100, 10, 3)
    assert check_stop_token(params, STOP_ID, 2, None) == (True, STOP_ID)
    assert check_stop_token(params, STOP_ID, 1, None) == (False, None)  # min_tokens
    assert check_stop_token(params, EOS, 2, None) == (False, None)  # EOS unknown
    assert check_stop_token(params, EOS, 2, EOS) == (True, None)


@pytest.mark.parametrize("max_tokens, num_output, expected", [
    (None, 0, 7), (None, 6, 1), (None, 7, 0), (4, 1, 3), (4, 4, 0), (9, 5, 2)])
def test_num_tokens_left(max_tokens, num_output, expected):
    # 3 prompt tokens, max_model_len 10: the nearer cap counts.
    assert num_tokens_left(SamplingParams(max_tokens=max_tokens), 10, 3, num_output) == expected
    assert at_length_limit(SamplingParams(max_tokens=max_tokens), 10, 3, num_output) == \
        (expected <= 0)
