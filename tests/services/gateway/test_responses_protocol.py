"""The Responses API's translations (no engines): request -> chat request, chat answer and
chat stream -> Response object and events, the in-memory store (issue 32). End to end:
tests/e2e/test_responses.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.response_store import MemoryResponseStore
from pdserve.services.gateway.responses_protocol import (
    ResponsesRequest,
    chat_messages,
    check_responses_request,
    to_chat_request,
)
from pdserve.services.gateway.serving_responses import _Turn, output_items, response_usage

WEATHER = {"type": "function", "name": "get_weather", "description": "weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _req(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"input": "Hi", **body}))


def test_a_conversation_becomes_chat_messages():
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": "20C"},
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "Be brief."}]}]
    messages = chat_messages(items, "You are helpful.")
    assert messages == [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
         "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "20C"},
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}]


def test_the_request_maps_to_chat_fields():
    req = _req(instructions="Short.", max_output_tokens=7, temperature=0.5, top_p=0.9,
               tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
               parallel_tool_calls=False,
               text={"format": {"type": "json_schema", "name": "p", "schema": {
                   "type": "object"}, "strict": True}})
    chat = to_chat_request(req, history=[{"role": "user", "content": "Earlier"}])
    assert [m.role for m in chat.messages] == ["system", "user", "user"]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p) == (7, 0.5, 0.9)
    assert chat.tools == [{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}, "strict": True}}
    assert to_chat_request(_req(text={"format": {"type": "json_object"}}), []
                           ).response_format == {"type": "json_object"}
    assert to_chat_request(_req(tool_choice="auto"), []).tool_choice is None  # no tools


@pytest.mark.parametrize("body,param", [
    ({"background": True}, "background"), ({"include": ["file_search_call.results"]}, "include"),
    ({"reasoning": {"effort": "low"}}, "reasoning"), ({"conversation": "c"}, "conversation"),
    ({"prompt": {"id": "p"}}, "prompt"), ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"max_output_tokens": 0}, "max_output_tokens")])
def test_unsupported_fields_are_refused_by_name(body, param):
    with pytest.raises(GatewayError) as info:
        check_responses_request(_req(**body))
    assert (info.value.status_code, info.value.param) == (400, param)


def test_values_without_effect_pass():
    check_responses_request(_req(background=False, include=[], reasoning={"effort": None},
                                 truncation="disabled", top_logprobs=0, store=None,
                                 service_tier="auto", metadata={"k": "v"}, unknown_field=1))


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "web_search"}]), ("tools", [{"type": "mcp", "server_label": "x"}]),
    ("tool_choice", {"type": "web_search_preview"}), ("text", {"format": {"type": "grammar"}}),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    ("input", [{"type": "item_reference", "id": "msg_1"}]),
    ("input", [{"type": "function_call_output", "output": "x"}])])
def test_untranslatable_parts_are_a_400_naming_the_field(field, value):
    with pytest.raises(GatewayError) as info:
        to_chat_request(_req(**{field: value}), [])
    assert (info.value.status_code, info.value.param) == (400, field)


def test_a_chat_answer_becomes_output_items_and_usage():
    message = {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "call_9", "type": "function",
         "function": {"name": "get_weather", "arguments": "{}"}}]}
    items = output_items(message, "completed")
    assert [i["type"] for i in items] == ["message", "function_call"]
    assert items[0]["content"][0]["text"] == "Sure." and items[0]["id"].startswith("msg_")
    assert (items[1]["call_id"], items[1]["name"], items[1]["arguments"]) == \
        ("call_9", "get_weather", "{}")
    assert [i["type"] for i in output_items({**message, "content": None}, "completed")] == \
        ["function_call"]
    assert output_items({"content": ""}, "incomplete")[0]["status"] == "incomplete"
    assert response_usage({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                           "prompt_tokens_details": {"cached_tokens": 4}}) == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}


class _FakeChatOutput:
    def __init__(self, deltas: list[dict], finish: str) -> None:
        self.deltas, self.finish = deltas, finish

    async def stream_chunks(self, run, first):
        yield {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        for i, delta in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            yield {"choices": [{"index": 0, "delta": delta,
                                "finish_reason": self.finish if last else None}]}


class _FakeRun:
    def usage(self) -> dict:
        return {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}


class _FakeServing:
    class chat:  # noqa: N801
        class config:  # noqa: N801
            served_model_name = "m"

    async def save(self, tenant, response, conversation):
        self.saved = (tenant, response, conversation)


def _stream(deltas: list[dict], finish: str) -> tuple[list[dict], _FakeServing]:
    serving = _FakeServing()
    turn = _Turn(serving, _req(), "t", [{"role": "user", "content": "Hi"}])  # type: ignore
    turn.chat_out = _FakeChatOutput(deltas, finish)

    async def collect():
        return [json.loads(turn.frame(e).split("data: ", 1)[1])
                async for e in turn.events(_FakeRun(), None)]  # type: ignore[arg-type]
    return asyncio.run(collect()), serving


def test_a_chat_stream_becomes_responses_events():
    events, serving = _stream([
        {"content": "Let me "}, {"content": "check."},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}], "tool_calls")
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[6]["text"] == "Let me check."
    assert events[12]["arguments"] == '{"city": "Paris"}' and events[12]["output_index"] == 1
    final = events[-1]["response"]
    assert [i["status"] for i in final["output"]] == ["completed", "completed"]
    assert final["usage"]["output_tokens"] == 6
    assert serving.saved[1] == final and serving.saved[0] == "t"


def test_a_cut_stream_is_incomplete():
    events, _ = _stream([{"content": "Once upon"}], "length")
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_an_error_is_openais_error_event():
    _, serving = _stream([{"content": "x"}], "stop")
    turn = _Turn(serving, _req(), "t", [])  # type: ignore[arg-type]
    text = turn.frame(GatewayError("boom", 503).to_dict())
    assert text.startswith("event: error\n")
    assert json.loads(text.split("data: ", 1)[1]) == {
        "type": "error", "code": "503", "message": "boom", "param": None,
        "sequence_number": 0}


def test_the_memory_store_scopes_by_tenant_and_expires():
    async def run():
        store = MemoryResponseStore(ttl=60, max_records=2)
        await store.put("a", "r1", {"x": 1})
        assert await store.get("a", "r1") == {"x": 1}
        assert await store.get("b", "r1") is None
        assert not await store.delete("b", "r1") and await store.delete("a", "r1")
        await store.put("a", "r2", {}), await store.put("a", "r3", {})
        await store.put("a", "r4", {})
        assert await store.get("a", "r2") is None  # the oldest, past max_records
        expired = MemoryResponseStore(ttl=0.0)
        await expired.put("a", "r", {})
        assert await expired.get("a", "r") is None
    asyncio.run(run())
