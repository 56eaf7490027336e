"""The gateway's reading of response_format / structured_outputs / guided_* (no engine)."""

from __future__ import annotations

import pytest

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.services.gateway.structured_outputs import resolve_structured_outputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _resolve(cls=ChatCompletionRequest, **body):
    base = {"messages": [{"role": "user", "content": "x"}]} if cls is ChatCompletionRequest \
        else {"prompt": "x"}
    return resolve_structured_outputs(cls.model_validate({**base, **body}))


@pytest.mark.parametrize("body,kind,param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                  "schema": SCHEMA}}},
     "json", "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, "json", "structured_outputs"),
    ({"structured_outputs": {"regex": "a+", "backend": "xgrammar"}}, "regex",
     "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", "structured_outputs"),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}, "json",
     "guided_json"),
    ({"guided_choice": ["x"]}, "choice", "guided_choice"),
])
@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
def test_each_spelling_becomes_one_constraint(body, kind, param, cls):
    params, got_param = _resolve(cls, **body)
    assert params.kind == kind and got_param == param
    if kind == "json":  # however it was given, one cache key per schema
        assert params.json == '{"type":"object","properties":{"a":{"type":"integer"}}}'


def test_text_and_nothing_are_unconstrained():
    assert _resolve(response_format={"type": "text"}) == (None, None)
    assert _resolve() == (None, None)


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     "response_format", "schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format", "JSON schema object"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown field"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
     "structured_outputs", "must be a boolean"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {}}, None, None),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one of"),
])
def test_bad_shapes_are_400s_naming_the_field(body, param, message):
    if message is None:
        assert _resolve(**body) == (None, None)
        return
    with pytest.raises(GatewayError) as info:
        _resolve(**body)
    assert info.value.status_code == 400 and info.value.param == param
    assert message in info.value.message
