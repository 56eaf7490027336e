"""Tool calling with `--tool-call-parser llama3_json` and `mistral` end to end (issue 34):
real prefill and decode services (in-process gRPC, real engines), the real gateway with
that parser and its shipped template, and the `openai` client.

The 135M test model knows neither format: forced tool_choice (`required`, a named
function) makes it write the parser's own markup through the grammar, and for `auto` a
regex makes it write text then a call, which the parser (not a grammar) turns into
tool_calls. Streamed and whole answers must agree, arguments to the character.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import jsonschema
import pytest
import pytest_asyncio

from pdserve.services.gateway.config import read_chat_template
from tests.e2e.conftest import E2E_ENGINE, Urls
from tests.e2e.test_structured_outputs import PARAMETERS, QUESTION, TOOLS, _tool_calls
from tests.services.gateway.conftest import SERVED_MODEL, RunningGateway, running_gateway
from tests.services.helpers import Cluster, start_cluster

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

TEMPLATES = {"llama3_json": "tool_chat_template_llama3.1_json.jinja",
             "mistral": "tool_chat_template_mistral.jinja"}
CALL = {"llama3_json": r'\{"name": "get_weather", "parameters": \{"city": "Paris", '
                       r'"unit": "celsius"\}\}',
        "mistral": r'\[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"city": '
                   r'"Paris", "unit": "celsius"\}\}\]'}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(model_path) -> AsyncIterator[Cluster]:
    c = await start_cluster(model_path, None, **E2E_ENGINE)
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(TEMPLATES))
async def gateway(request, model_path, cluster) -> AsyncIterator[RunningGateway]:
    urls = Urls((cluster.prefill.identity.address,), (cluster.decode.identity.address,))
    async with running_gateway(  # type: ignore[arg-type]
            model_path, urls, rpc_timeout=10.0,
            chat_template=read_chat_template(TEMPLATES[request.param]),
            enable_auto_tool_choice=True, tool_call_parser=request.param) as gw:
        gw.client = gw.client.with_options(timeout=120)
        yield gw


def _id_ok(parser: str, call_id: str) -> bool:
    if parser == "mistral":  # Mistral's ids: 9 alphanumeric characters
        return len(call_id) == 9 and call_id.isalnum()
    return call_id.startswith("call_")


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
async def test_forced_tool_calls_validate_and_stream_the_same(gateway, tool_choice):
    parser = gateway.config.tool_call_parser
    whole, finish = await _tool_calls(gateway.client, QUESTION, stream=False,
                                      tool_choice=tool_choice)
    streamed, stream_finish = await _tool_calls(gateway.client, QUESTION, stream=True,
                                                tool_choice=tool_choice)
    assert finish == stream_finish == "tool_calls"
    assert whole and [c[1:] for c in whole] == [c[1:] for c in streamed]
    for call_id, name, arguments in whole + streamed:
        assert _id_ok(parser, call_id), call_id
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    if isinstance(tool_choice, dict):
        assert [c[1] for c in whole] == ["get_time"]


async def test_auto_parses_the_models_markup_streamed_and_not(gateway):
    parser = gateway.config.tool_call_parser
    kwargs = {"tool_choice": "auto",
              "extra_body": {"structured_outputs": {"regex": r"I will check\." + CALL[parser]}}}
    whole, finish = await _tool_calls(gateway.client, QUESTION, stream=False, **kwargs)
    streamed, stream_finish = await _tool_calls(gateway.client, QUESTION, stream=True, **kwargs)
    assert finish == stream_finish == "tool_calls"
    expected = [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert [c[1:] for c in whole] == [c[1:] for c in streamed] == expected
    assert all(_id_ok(parser, c[0]) for c in whole + streamed)
    resp = await gateway.client.chat.completions.create(
        model=SERVED_MODEL, messages=QUESTION, tools=TOOLS, max_tokens=64, temperature=0,
        **kwargs)
    assert resp.choices[0].message.content == "I will check."


async def test_text_is_content_and_a_follow_up_turn_renders(gateway):
    """No markup: content and finish_reason stop. Then the call and its result go back
    through the template (assistant tool_calls, a tool message) into a second turn."""
    kwargs = {"tool_choice": "auto",
              "extra_body": {"structured_outputs": {"regex": "It is sunny in Paris\\."}}}
    resp = await gateway.client.chat.completions.create(
        model=SERVED_MODEL, messages=QUESTION, tools=TOOLS, max_tokens=16, temperature=0,
        **kwargs)
    choice = resp.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == \
        ("It is sunny in Paris.", None, "stop")
    calls, _ = await _tool_calls(gateway.client, QUESTION, stream=False, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    call_id, name, arguments = calls[0]
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 18}'}]
    resp = await gateway.client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, tools=TOOLS, tool_choice="auto",
        max_tokens=16, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
