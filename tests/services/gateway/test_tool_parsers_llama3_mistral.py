"""The llama3_json and mistral tool-call parsers (services/gateway/tool_parsers/), their
forced-call grammars, templates and flag, without engines (end to end:
tests/e2e/test_tool_parsers.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.services.gateway.config import GatewayConfig, read_chat_template
from pdserve.services.gateway.protocol import ChatCompletionRequest
from pdserve.services.gateway.tool_parsers import TOOL_PARSERS, get_tool_parser
from pdserve.services.gateway.tool_parsers.base import assemble
from pdserve.services.gateway.tools import resolve_tool_mode

ARGS = '{"city": "Paris", "n": [1, {"a": "}{]["}], "q": "say \\"hi\\""}'
ARGS2 = '{"timezone": "Europe/Oslo"}'
LLAMA = "llama3_json"
MISTRAL = "mistral"

CASES = [
    # (parser, answer, content, [(name, arguments)])
    (LLAMA, '{"name": "get_weather", "parameters": ' + ARGS + "}", None,
     [("get_weather", ARGS)]),
    (LLAMA, "Let me check. <|python_tag|>{\"name\": \"get_weather\", \"parameters\": " + ARGS +
     '}; {"name": "get_time", "arguments": ' + ARGS2 + "}", "Let me check.",
     [("get_weather", ARGS), ("get_time", ARGS2)]),
    (LLAMA, '{"parameters": {"a":1}, "name": "f"}', None, [("f", '{"a": 1}')]),
    (LLAMA, "Paris is sunny {today}.", "Paris is sunny {today}.", []),
    (LLAMA, '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),
    (LLAMA, "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + ARGS + '}, '
     '{"name": "get_time", "arguments": ' + ARGS2 + ', "id": "abcDEF123"}]', None,
     [("get_weather", ARGS), ("get_time", ARGS2)]),
    (MISTRAL, 'Sure.[TOOL_CALLS]get_weather[ARGS]' + ARGS + '[TOOL_CALLS]get_time[ARGS]' +
     ARGS2, "Sure.", [("get_weather", ARGS), ("get_time", ARGS2)]),
    (MISTRAL, "[TOOL_CALLS]get_time" + ARGS2, None, [("get_time", ARGS2)]),  # v11: no [ARGS]
    (MISTRAL, '[TOOL_CALLS][{"arguments": {"a":1}, "name": "f"}]', None, [("f", '{"a": 1}')]),
    (MISTRAL, "[TOOL_ is not a call, nor [TOOL_CALLS] this one",
     "[TOOL_ is not a call, nor [TOOL_CALLS] this one", []),
]


def _stream(parser: str, text: str, size: int) -> tuple[str, list, int]:
    """(content, calls, num_calls) reassembled from `text` fed `size` characters at a time."""
    stream = get_tool_parser(parser).stream()
    pieces = []
    for i in range(0, len(text), size):
        pieces += stream.feed(text[i:i + size])
    pieces += stream.finish()
    for piece in pieces:  # every delta is one OpenAI chat delta
        assert set(piece) in ({"content"}, {"tool_calls"}), piece
    return *assemble(pieces), stream.num_calls


def _id_ok(parser: str, call_id: str) -> bool:
    if parser == MISTRAL:
        return len(call_id) == 9 and call_id.isalnum()
    return call_id.startswith("call_")


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_streamed_deltas_reassemble_to_the_whole_answer_parse(parser, text, content, calls,
                                                               size):
    got_content, got_calls = get_tool_parser(parser).extract_tool_calls(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(_id_ok(parser, c.id) for c in got_calls)
    for call in got_calls:
        json.loads(call.arguments)
    streamed_content, streamed, num_calls = _stream(parser, text, size)
    assert streamed_content.strip() == ((content or "") if calls else text).strip()
    assert [(c.name, c.arguments) for c in streamed] == calls  # arguments exactly
    assert all(_id_ok(parser, c.id) for c in streamed)
    assert num_calls == len(calls)


@pytest.mark.parametrize("parser,text", [
    (LLAMA, '{"name": "f", "parameters": {"city": "Par'),  # cut by max_tokens
    (MISTRAL, '[TOOL_CALLS] [{"name": "f", "arguments": {"city": "Par'),
    (MISTRAL, '[TOOL_CALLS]f[ARGS]{"city": '),
])
def test_a_call_cut_short_is_content_whole_and_streams_what_it_had(parser, text):
    assert get_tool_parser(parser).extract_tool_calls(text) == (text, [])
    _, streamed, num_calls = _stream(parser, text, 3)
    assert num_calls == 1 and streamed[0].name == "f"
    assert text.endswith(streamed[0].arguments)


def test_arguments_stream_as_the_model_writes_them():
    stream = get_tool_parser(LLAMA).stream()
    assert stream.feed('{"name": "f", "parameters": ') == []  # the arguments start with "{"
    head, args = stream.feed('{"city": "Pa')
    assert head["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}
    assert stream.feed('ris"}}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}]
    assert stream.finish() == [] and stream.num_calls == 1


TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {key: {"type": "string"}}, "required": [key]}}}
    for name, key in (("get_weather", "city"), ("get_time", "timezone"))]


def _mode(parser: str, **body):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **body})
    return resolve_tool_mode(req, enable_auto_tool_choice=True, template_renders_tools=True,
                             parser=get_tool_parser(parser))


@pytest.mark.parametrize("parser,required,named", [
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {"timezone": "UTC"}}',
     '{"name": "get_time", "parameters": {"timezone": "UTC"}}'),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {"timezone": "UTC"}}]',
     '[TOOL_CALLS] [{"name": "get_time", "arguments": {"timezone": "UTC"}}]'),
])
def test_forced_calls_are_written_in_the_parsers_format(parser, required, named, tokenizer):
    """The grammar of `required` / a named function accepts that parser's markup (and the
    parser reads it back); a named call of another function is refused."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer)))

    def accepts(mode, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(
            mode.structured_outputs.structural_tag))
        return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)

    assert accepts(_mode(parser, tool_choice="required"), required)
    only = _mode(parser, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert accepts(only, named)
    assert not accepts(only, named.replace("get_time", "get_weather"))
    assert not accepts(_mode(parser, tool_choice="required", parallel_tool_calls=False),
                       required)
    for text, names in ((required, ["get_weather", "get_time"]), (named, ["get_time"])):
        _, calls = get_tool_parser(parser).extract_tool_calls(text)
        assert [c.name for c in calls] == names


def test_mistral_keeps_special_tokens_where_llama_and_hermes_skip_them():
    """[TOOL_CALLS] is a special token of Mistral's tokenizers (vLLM's adjust_request)."""
    assert [TOOL_PARSERS[n].skip_special_tokens for n in ("hermes", LLAMA, MISTRAL)] == \
        [True, True, False]


@pytest.mark.parametrize("parser,template", [
    (LLAMA, "tool_chat_template_llama3.1_json.jinja"),
    (MISTRAL, "tool_chat_template_mistral.jinja"),
])
def test_the_templates_render_tools_calls_and_results(parser, template, tokenizer):
    """Past calls come back in the parser's own format, so the model sees what it must
    write; tool results and the tools' schemas reach the prompt."""
    from pdserve.services.gateway.tokenization import GatewayTokenizer
    from pdserve.shared.chat_encoding import render_chat_pieces

    text = read_chat_template(template)
    assert GatewayTokenizer(tokenizer, text).renders_tools
    calls = [{"id": "abcDEF123", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
             {"id": "ghiJKL456", "type": "function",
              "function": {"name": "get_time", "arguments": {"timezone": "UTC"}}}]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather and time in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"sky": "sunny"}'},
                {"role": "tool", "tool_call_id": "ghiJKL456", "content": '{"time": "09:00"}'}]
    prompt = "".join(p for _, p in render_chat_pieces(tokenizer, messages,
                                                      chat_template=text, tools=TOOLS))
    assert "Be brief." in prompt and '"get_time"' in prompt
    assert '{"sky": "sunny"}' in prompt and '{"time": "09:00"}' in prompt
    written = prompt.split("Weather and time in Paris?")[1]
    _, parsed = get_tool_parser(parser).extract_tool_calls(written)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})]
    plain = "".join(p for _, p in render_chat_pieces(tokenizer, messages[1:2],
                                                     chat_template=text))
    assert "get_weather" not in plain and "Weather and time in Paris?" in plain


def test_an_unknown_parser_is_refused_in_one_line(model_path, capsys):
    from pdserve.services.gateway.__main__ import main

    for name in TOOL_PARSERS:
        assert GatewayConfig(model_path=model_path, tool_call_parser=name,
                             enable_auto_tool_choice=True).tool_call_parser == name
    with pytest.raises(ValueError, match="^--tool-call-parser must be one of hermes, "
                                         "llama3_json, mistral, got 'llama3'$"):
        GatewayConfig(model_path=model_path, tool_call_parser="llama3")
    assert main(["--model", model_path, "--tool-call-parser", "pythonic"]) == 2
    assert capsys.readouterr().err == ("error: --tool-call-parser must be one of hermes, "
                                       "llama3_json, mistral, got 'pythonic'\n")


def test_pdserve_up_refuses_an_unknown_parser_before_starting_anything(model_path, capsys):
    import argparse

    from pdserve.services.launcher.config import add_up_args, config_from_args
    from pdserve.services.launcher.up import main

    parser = add_up_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", model_path, "--tool-call-parser", "llama"])
    ns.log_level = "INFO"
    assert main(ns) == 2
    assert capsys.readouterr().err == ("error: --tool-call-parser must be one of hermes, "
                                       "llama3_json, mistral, got 'llama'\n")
    ok = parser.parse_args(["--model", model_path, "--tool-call-parser", "mistral"])
    ok.log_level = "INFO"
    flags = config_from_args(ok).gateway_flags
    assert flags[flags.index("--tool-call-parser") + 1] == "mistral"
