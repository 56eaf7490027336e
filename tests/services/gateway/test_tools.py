"""Hermes tool-call parsing (services/gateway/tool_parsers/hermes.py) and tool_choice resolution
(services/gateway/tools.py), without engines."""

from __future__ import annotations

import json

import pytest

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.protocol import ChatCompletionRequest
from pdserve.services.gateway.tool_parsers.hermes import HermesStream, extract_tool_calls
from pdserve.services.gateway.tools import resolve_tool_mode

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {}]}}\n' \
       '</tool_call>'


def _stream(text: str, size: int) -> tuple[str, list[dict]]:
    """(content, calls as {index: {"id", "name", "arguments"}}) reassembled from deltas."""
    parser = HermesStream()
    pieces = []
    for i in range(0, len(text), size):
        pieces += parser.feed(text[i:i + size])
    pieces += parser.finish()
    content, calls = "", {}
    for piece in pieces:
        content += piece.get("content", "")
        for d in piece.get("tool_calls", []):
            call = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = d.get("id", call["id"])
            call["name"] += d.get("function", {}).get("name", "")
            call["arguments"] += d.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("text,content,calls", [
    (CALL, None, [("get_weather", '{"city": "Paris", "n": [1, {}]}')]),
    ("Let me check. " + CALL + "\n" + CALL.replace("Paris", "Oslo"), "Let me check.",
     [("get_weather", '{"city": "Paris", "n": [1, {}]}'),
      ("get_weather", '{"city": "Oslo", "n": [1, {}]}')]),
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),
    ("no calls < here <tool", "no calls < here <tool", []),
])
def test_streamed_deltas_reassemble_to_the_whole_answer_parse(text, content, calls, size):
    got_content, got_calls = extract_tool_calls(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    for call in got_calls:
        json.loads(call.arguments)
    streamed_content, streamed = _stream(text, size)
    assert streamed_content.strip() == (content or "").strip()
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    assert all(c["id"].startswith("call_") for c in streamed)


def test_a_malformed_call_is_left_as_content():
    text = '<tool_call>{"name": "f", "arguments": {"a": </tool_call>'
    assert extract_tool_calls(text) == (text, [])


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _mode(auto=False, renders=True, **body):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                **body})
    return resolve_tool_mode(req, enable_auto_tool_choice=auto, template_renders_tools=renders)


@pytest.mark.parametrize("body,param,message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "not in tools"),
    ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}],
      "tool_choice": "required"}, "tools", "must match"),
    ({"tools": TOOLS * 2, "tool_choice": "required"}, "tools", "given twice"),
])
def test_bad_tool_requests_are_400s_naming_the_field(body, param, message):
    with pytest.raises(GatewayError) as info:
        _mode(**body)
    assert info.value.status_code == 400 and info.value.param == param
    assert message in info.value.message


def test_a_template_without_tools_refuses_them():
    with pytest.raises(GatewayError, match="cannot render tools") as info:
        _mode(renders=False, tools=TOOLS, tool_choice="required")
    assert info.value.param == "tools"


def test_forced_modes_carry_a_structural_tag():
    required = _mode(tools=TOOLS, tool_choice="required")
    tag = json.loads(required.structured_outputs.structural_tag)
    assert tag["format"]["type"] == "tags_with_separator" and tag["format"]["at_least_one"]
    assert not tag["format"]["stop_after_first"]
    single = _mode(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.structured_outputs.structural_tag)["format"]["stop_after_first"]
    named = _mode(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})
    assert json.loads(named.structured_outputs.structural_tag)["format"]["begin"] == \
        '<tool_call>\n{"name": "f", "arguments": '
    assert _mode(auto=True, tools=TOOLS).structured_outputs is None
    assert _mode(tools=TOOLS, tool_choice="none").parses_calls is False


def test_the_shipped_template_renders_tools_and_nothing_else_differently(fast_tokenizer):
    from pdserve.services.gateway.config import read_chat_template
    from pdserve.services.gateway.tokenization import GatewayTokenizer

    template = read_chat_template("tool_chat_template_smollm2_hermes.jinja")
    assert not GatewayTokenizer(fast_tokenizer).renders_tools  # the model's own template
    assert GatewayTokenizer(fast_tokenizer, template).renders_tools
    for conversation in ([{"role": "user", "content": "hi"}],
                         [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                          {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]):
        for add_generation_prompt in (True, False):
            kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
            assert fast_tokenizer.apply_chat_template(conversation, **kwargs) == \
                fast_tokenizer.apply_chat_template(conversation, chat_template=template, **kwargs)
    rendered = fast_tokenizer.apply_chat_template(
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
         {"role": "tool", "content": "sunny"}],
        tools=TOOLS, chat_template=template, tokenize=False)
    assert "<tools>\n" + json.dumps(TOOLS[0]["function"]) in rendered
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>' in rendered
    assert "<tool_response>\nsunny\n</tool_response>" in rendered
