"""XgrammarBackend on the default model's tokenizer, and StructuredOutputsParams checks."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.shared.structured_output.backend import XgrammarBackend, compile_error_text
from pdserve.shared.structured_output.params import StructuredOutputsParams as S

VOCAB = 49152


@pytest.fixture(scope="module")
def backend(model_path):
    return XgrammarBackend(model_path, VOCAB)


def _accepts(backend, compiled, text: str) -> bool:
    matcher = backend.new_matcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("params,good,bad", [
    (S(json=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                        "required": ["a"]})), '{"a": 12}', '{"a": "x"}'),
    (S(json_object=True), '{"k": [1, "v"]}', "[1, 2]"),
    (S(regex=r"\d{3}-[a-z]+"), "123-abc", "12-abc"),
    (S(choice=("yes", 'say "no"\n')), 'say "no"\n', "maybe"),
    (S(grammar='root ::= term ("+" term)*\nterm ::= [0-9]+'), "1+22+3", "1++2"),
])
def test_each_kind_compiles_and_constrains(backend, params, good, bad):
    compiled = backend.compile(params)
    assert _accepts(backend, compiled, good)
    assert not _accepts(backend, compiled, bad)


@pytest.mark.parametrize("params,message", [
    (S(json='{"type": "bogus"}'), 'invalid JSON schema: Unsupported type "bogus"'),
    (S(json="{not json"), "invalid JSON schema: Failed to parse JSON"),
    (S(regex="(abc"), "invalid regex: Regex parsing error"),
    (S(grammar="root ::= missing"), 'invalid grammar: EBNF parser error at line 1'),
    (S(structural_tag='{"type": "structural_tag"}'), "invalid structural tag"),
])
def test_compile_errors_are_value_errors_without_the_cpp_prefix(backend, params, message):
    with pytest.raises(ValueError) as info:
        backend.compile(params)
    assert str(info.value).startswith(message)
    assert ".cc:" not in str(info.value)


def test_bitmask_masks_only_the_given_rows(backend):
    compiled = backend.compile(S(choice=("yes", "no")))
    matcher = backend.new_matcher(compiled)
    bitmask = backend.allocate_bitmask(2)
    matcher.fill_next_token_bitmask(bitmask, 1)
    logits = torch.zeros(2, VOCAB)
    backend.apply_bitmask(logits, bitmask, [1])
    assert torch.isfinite(logits[0]).all()
    assert 0 < int(torch.isfinite(logits[1]).sum()) < 10


def test_compile_error_text_strips_the_log_prefix():
    err = RuntimeError("[21:12:41] /project/cpp/x.cc:94: Check failed: (a) is false: boom\n")
    assert compile_error_text(err) == "boom"


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one of"),
    ({"json": "{}", "regex": "a"}, "exactly one of"),
    ({"choice": ()}, "non-empty list"),
    ({"choice": ("a", "")}, "non-empty list of non-empty strings"),
    ({"regex": "  "}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": "x" * 300_000}, "at most"),
])
def test_params_refuse_bad_specs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        S(**kwargs)


def test_params_key_identifies_the_grammar():
    assert S(regex="a").key == S(regex="a").key != S(grammar="a").key
    assert S(json="{}").key != S(json="{}", disable_any_whitespace=True).key


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_forced_tool_call_arguments_obey_the_whitespace_cap(backend, parser):
    """A forced call's arguments are JSON like response_format's: at most 4 blanks in a row
    (a tryout saw a tiny model fill max_tokens with blanks inside the arguments)."""
    from pdserve.services.gateway.tool_parsers import get_tool_parser
    from pdserve.services.gateway.tools import ToolMode, parse_tools

    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}])
    mode = ToolMode(tools, "named", named="f", parser=get_tool_parser(parser))
    compiled = backend.compile(mode.structured_outputs)
    matcher = backend.new_matcher(compiled)
    head = {"hermes": '<tool_call>\n{"name": "f", "arguments": ',
            "llama3_json": '{"name": "f", "parameters": ',
            "mistral": '[TOOL_CALLS] [{"name": "f", "arguments": '}[parser]
    if not matcher.accept_string(head):
        pytest.skip(f"{parser}'s forced prefix differs from {head!r}")
    assert matcher.accept_string('{"a":    "x"')  # 4 blanks: allowed
    wide = backend.new_matcher(compiled)
    assert wide.accept_string(head)
    assert not wide.accept_string('{"a":' + " " * 5 + '"x"')
