"""The Responses API end to end (issue 32): the real gateway (two API keys, Redis, the
hermes tool template) in front of real prefill and decode services, through the `openai`
client: plain text, streamed events, a forced tool call and its follow-up turn by
previous_response_id, a JSON schema, max_output_tokens, store, tenants, a second gateway
continuing the first's conversation, Redis down, and the refusals.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import jsonschema
import openai
import pytest
import pytest_asyncio

from pdserve.services.gateway.config import read_chat_template
from tests.e2e.conftest import Urls
from tests.e2e.test_structured_outputs import PARAMETERS, PERSON, QUESTION, TOOLS
from tests.procs import free_port
from tests.services.gateway.conftest import RunningGateway, running_gateway

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

KEY_A, KEY_B = "sk-responses-a", "sk-responses-b"
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ASK = QUESTION[0]["content"]
EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done"]


def _options(urls: Urls, redis_url: str, model_name: str) -> dict:
    return dict(api_key=f"{KEY_A},{KEY_B}", redis_url=redis_url,
                served_model_name=model_name, rpc_timeout=10.0,
                chat_template=read_chat_template("tool_chat_template_smollm2_hermes.jinja"),
                enable_auto_tool_choice=True, tool_call_parser="hermes")


@pytest.fixture(scope="module")
def urls(redis_cluster) -> Urls:
    return Urls((redis_cluster.prefill.identity.address,),
                (redis_cluster.decode.identity.address,))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(model_path, urls, redis_cluster, redis_server
                  ) -> AsyncIterator[RunningGateway]:
    async with running_gateway(model_path, urls, **_options(  # type: ignore[arg-type]
            urls, redis_server.url, redis_cluster.prefill.worker.model_name)) as gw:
        yield gw


def _client(gw: RunningGateway, key: str) -> openai.AsyncOpenAI:
    return gw.client.with_options(api_key=key, timeout=120)


@pytest.fixture(scope="module")
def model(redis_cluster) -> str:
    return redis_cluster.prefill.worker.model_name


async def test_plain_text_and_the_stream_agree(gateway, model):
    client = _client(gateway, KEY_A)
    kwargs = dict(model=model, input="Name a colour.", instructions="Answer in one word.",
                  max_output_tokens=24, temperature=0)
    whole = await client.responses.create(**kwargs)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.output_text and [item.type for item in whole.output] == ["message"]
    usage = whole.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens < 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0

    events = [e async for e in await client.responses.create(stream=True, **kwargs)]
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert list(dict.fromkeys(types)) == EVENT_ORDER + ["response.completed"]
    assert types.index("response.output_text.done") > max(
        i for i, t in enumerate(types) if t == "response.output_text.delta")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text == whole.output_text  # greedy: the same
    assert final.status == "completed" and final.usage.output_tokens == usage.output_tokens
    assert events[0].response.status == "in_progress"


async def test_max_output_tokens_is_incomplete(gateway, model):
    client = _client(gateway, KEY_A)
    resp = await client.responses.create(model=model, input="Tell me a long story.",
                                         max_output_tokens=3, temperature=0)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.max_output_tokens == 3
    events = [e async for e in await client.responses.create(
        model=model, input="Tell me a long story.", max_output_tokens=3, temperature=0,
        stream=True)]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == resp.output_text


async def test_forced_tool_call_then_its_follow_up_turn(gateway, model):
    client = _client(gateway, KEY_A)
    first = await client.responses.create(
        model=model, input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=64, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", first.output
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), PARAMETERS["get_weather"])

    streamed = [e async for e in await client.responses.create(
        model=model, input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=64, temperature=0,
        tool_choice="required", stream=True)]
    types = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in types
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in streamed
                     if e.type == "response.function_call_arguments.delta")
    assert done and deltas == "".join(e.arguments for e in done)
    final_calls = [i for i in streamed[-1].response.output if i.type == "function_call"]
    assert [c.arguments for c in final_calls] == [e.arguments for e in done]

    # The follow-up names the first turn and answers its call; the gateway rebuilds the
    # conversation from Redis: the same prompt as the whole conversation sent to chat.
    output = '{"temperature": 18, "unit": "celsius"}'
    follow = await client.responses.create(
        model=model, previous_response_id=first.id, tools=RESPONSES_TOOLS,
        tool_choice="none", max_output_tokens=16, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": output}])
    assert follow.previous_response_id == first.id and follow.output_text
    chat = await client.chat.completions.create(
        model=model, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0,
        messages=QUESTION + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": calls[0].call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": output}])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == chat.choices[0].message.content


async def test_json_schema_through_text_format(gateway, model):
    resp = await _client(gateway, KEY_A).responses.create(
        model=model, input="Describe a pirate as JSON with a name and an age.",
        max_output_tokens=64, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), PERSON)
    assert resp.text.format.type == "json_schema"


async def test_store_retrieve_delete_and_tenants(gateway, model):
    a, b = _client(gateway, KEY_A), _client(gateway, KEY_B)
    kwargs = dict(model=model, input="Hi!", max_output_tokens=2, temperature=0)
    unstored = await a.responses.create(store=False, **kwargs)
    with pytest.raises(openai.NotFoundError):
        await a.responses.retrieve(unstored.id)
    stored = await a.responses.create(**kwargs)
    got = await a.responses.retrieve(stored.id)
    assert got.id == stored.id and got.output_text == stored.output_text and got.store
    with pytest.raises(openai.NotFoundError):  # another tenant's id does not exist for B
        await b.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        await b.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError) as info:
        await b.responses.create(previous_response_id=stored.id, **kwargs)
    assert info.value.body["param"] == "previous_response_id"
    await a.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        await a.responses.retrieve(stored.id)
    r = await gateway.http.get(f"/v1/responses/{stored.id}",
                               headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


async def test_another_gateway_continues_after_a_restart(model_path, urls, redis_server,
                                                         model):
    """Turn 1 on a gateway that then stops; turn 2 on a new one, against the same Redis."""
    options = _options(urls, redis_server.url, model)
    async with running_gateway(model_path, urls, **options) as gw:  # type: ignore[arg-type]
        first = await _client(gw, KEY_A).responses.create(
            model=model, input="My name is Ada. Say hi.", max_output_tokens=8, temperature=0)
    async with running_gateway(model_path, urls, **options) as gw:  # type: ignore[arg-type]
        client = _client(gw, KEY_A)
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text
        second = await client.responses.create(
            model=model, input="What is my name?", previous_response_id=first.id,
            max_output_tokens=8, temperature=0)
        assert second.status in ("completed", "incomplete")
        # the first turn's input and output are in the prompt: longer than the new input
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


async def test_redis_down_answers_but_cannot_continue(model_path, urls, model, caplog):
    options = {**_options(urls, f"redis://127.0.0.1:{free_port()}/0", model)}
    async with running_gateway(model_path, urls, **options) as gw:  # type: ignore[arg-type]
        client = _client(gw, KEY_A)
        resp = await client.responses.create(model=model, input="Hi!", max_output_tokens=2,
                                             temperature=0)
        assert resp.output_text and resp.store
        metrics = (await gw.http.get("/metrics")).text
        assert "pdserve_gateway_responses_store_failures_total 1.0" in metrics
        with pytest.raises(openai.InternalServerError) as info:
            await client.responses.create(model=model, input="Again", max_output_tokens=2,
                                          previous_response_id=resp.id)
        assert info.value.status_code == 503
        assert info.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("field,value", [
    ("background", True), ("tools", [{"type": "web_search"}]),
    ("include", ["message.output_text.logprobs"]), ("reasoning", {"effort": "high"}),
    ("conversation", "conv_123"), ("text", {"format": {"type": "grammar"}}),
    ("max_output_tokens", 0), ("truncation", "auto"),
    ("input", [{"type": "message", "role": "user",
                "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])])
async def test_unsupported_parts_are_a_400_naming_the_field(gateway, model, field, value):
    body = {"model": model, "input": "Hi!", field: value}
    r = await gateway.http.post("/v1/responses", json=body,
                                headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
