"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat
path.

A request becomes a chat request (responses_protocol.py) and runs through ChatServing
(template, tools, structured outputs, sampling, admission, streaming machinery); the chat
answer, or its stream of chunks, becomes a Response object or its events:

    response.created, response.in_progress
      per output item (a message, then each function call, in the order written):
        response.output_item.added
          message:       response.content_part.added, response.output_text.delta...,
                         response.output_text.done, response.content_part.done
          function_call: response.function_call_arguments.delta...,
                         response.function_call_arguments.done
        response.output_item.done
    response.completed   (response.incomplete, as OpenAI, when max_output_tokens cut it)

each an SSE `event: <type>` with `sequence_number` 0, 1, 2, ... in its data. A stored
response (`store`, default true) is saved before its last event goes out, so a follow-up
turn can name it at once (response_store.py).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import Counter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.output_processor import ChoiceDelta
from pdserve.services.gateway.response_store import (
    PUBLIC_TENANT,
    ResponseStore,
    StoreUnavailable,
)
from pdserve.services.gateway.responses_protocol import (
    ResponsesRequest,
    check_responses_request,
    input_items,
    to_chat_request,
)
from pdserve.services.gateway.serving import ChoiceRun
from pdserve.services.gateway.serving_chat import ChatServing

logger = logging.getLogger(__name__)

_CHAT_PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input",
                "response_format": "text"}
"""Chat fields an error may name -> the Responses field they came from."""


def _renamed(e: GatewayError) -> GatewayError:
    """`e` naming the Responses field instead of the chat field it was checked as."""
    if e.param in _CHAT_PARAMS:
        old, new = e.param, _CHAT_PARAMS[e.param]
        e.param, e.message = new, e.message.replace(old, new)
        e.args = (e.message,)
    return e


def _not_found(response_id: str, param: str | None = None) -> GatewayError:
    return GatewayError(f"Response with id '{response_id}' not found.", 404, param)


def _tenant(request: Request) -> str:
    return getattr(request.state, "tenant_cache_salt", None) or PUBLIC_TENANT


def response_usage(usage: dict) -> dict:
    """Chat usage -> Responses usage."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def message_item(text: str, status: str) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": status,
            "role": "assistant", "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}


def output_items(message: dict, status: str) -> list[dict]:
    """A chat answer's message -> Responses output items: its text (when it has any, or
    makes no call), then one function_call per tool call."""
    calls = message.get("tool_calls") or []
    items = [message_item(message.get("content") or "", status)] \
        if message.get("content") or not calls else []
    items += [function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"],
                                 status) for c in calls]
    return items


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore,
                 metrics: GatewayMetrics) -> None:
        self.chat = chat
        self.store = store
        self.store_failures = Counter(
            "pdserve_gateway_responses_store_failures",
            "Responses with store=true the response store (Redis) did not take; they were "
            "answered all the same.", registry=metrics.registry)

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        check_responses_request(req)
        tenant = _tenant(request)
        history: list[dict] = []
        if req.previous_response_id is not None:
            record = await self._load(tenant, req.previous_response_id, "previous_response_id")
            if record is None:
                raise GatewayError(f"Previous response with id '{req.previous_response_id}' "
                                   "not found.", 404, "previous_response_id")
            history = record["conversation"] + record["response"]["output"]
        turn = _Turn(self, req, tenant, history + input_items(req.input))
        try:
            started = await self.chat.start_chat(to_chat_request(req, history), request)
            assert not isinstance(started, Response)  # never a beam search
            run, turn.chat_out = started
            response = await self.chat.respond(request, run, bool(req.stream), turn.build_response,
                                               turn.events, False, {}, frame=turn.frame,
                                               done=False)
            if not req.stream:  # (a stream saves before its last event)
                await turn.save()
            return response
        except GatewayError as e:
            raise _renamed(e) from None

    async def retrieve(self, response_id: str, request: Request) -> Response:
        record = await self._load(_tenant(request), response_id, None)
        if record is None:
            raise _not_found(response_id)
        return JSONResponse(record["response"])

    async def delete(self, response_id: str, request: Request) -> Response:
        try:
            found = await self.store.delete(_tenant(request), response_id)
        except StoreUnavailable as e:
            raise _unavailable(e, None) from None
        if not found:
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _load(self, tenant: str, response_id: str, param: str | None) -> dict | None:
        try:
            return await self.store.get(tenant, response_id)
        except StoreUnavailable as e:
            raise _unavailable(e, param) from None

    async def save(self, tenant: str, response: dict, conversation: list[dict]) -> None:
        """Store `response` (log and count a failure: the client gets it all the same)."""
        try:
            await self.store.put(tenant, response["id"],
                                 {"response": response, "conversation": conversation})
        except StoreUnavailable as e:
            self.store_failures.inc()
            logger.warning("[%s] response not stored: the response store is unreachable (%s)",
                           response["id"], e)


def _unavailable(e: StoreUnavailable, param: str | None) -> GatewayError:
    return GatewayError(f"The response store (Redis) is unreachable ({e}); stored responses "
                        "cannot be read now, retry later.", 503, param)


class _Turn:
    """One Responses request: its Response object, or its stream of events."""

    def __init__(self, serving: ResponsesServing, req: ResponsesRequest, tenant: str,
                 conversation: list[dict]) -> None:
        self.serving, self.req, self.tenant = serving, req, tenant
        self.conversation = conversation
        """The stored chain's items, then this turn's input."""
        self.id = req.request_id or f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.chat_out = None
        self.final: dict | None = None
        self.sequence_number = 0
        self.output: list[dict] = []
        self._open: dict | None = None
        """The output item being streamed (None: none open)."""
        self._calls: dict[int, dict] = {}

    def response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        """The Response object (OpenAI's fields; the request's settings echoed)."""
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": None,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.serving.chat.config.served_model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": req.service_tier or "auto", "store": bool(req.store),
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text if req.text and req.text.get("format") else
            {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {}}

    async def save(self) -> None:
        if self.req.store and self.final is not None:
            await self.serving.save(self.tenant, self.final, self.conversation)

    def build_response(self, run: ChoiceRun, deltas: list[ChoiceDelta]) -> dict:
        chat = self.chat_out.build_response(run, deltas)  # type: ignore[union-attr]
        choice = chat["choices"][0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        self.final = self.response(status, output_items(choice["message"], status),
                                   response_usage(chat["usage"]))
        return self.final

    # -- streaming ----------------------------------------------------------------------------

    def frame(self, event: dict) -> str:
        """One SSE event, numbered; an error object becomes OpenAI's `error` event."""
        if "error" in event and "type" not in event:
            err = event["error"]
            event = {"type": "error", "code": str(err.get("code")), "message": err["message"],
                     "param": err.get("param")}
        event = {**event, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event['type']}\ndata: {data}\n\n"

    async def events(self, run: ChoiceRun, first: ChoiceDelta | None) -> AsyncIterator[dict]:
        """The Responses events of the chat stream's chunks (one choice)."""
        yield {"type": "response.created", "response": self.response("in_progress", [])}
        yield {"type": "response.in_progress", "response": self.response("in_progress", [])}
        finish = None
        async for chunk in self.chat_out.stream_chunks(run, first):  # type: ignore[union-attr]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                events = self._text(delta["content"]) if delta.get("content") else []
                for call in delta.get("tool_calls") or ():
                    events += self._call(call)
                for event in events:
                    yield event
                finish = choice.get("finish_reason") or finish
        status = "incomplete" if finish == "length" else "completed"
        for event in (self._text("") if not self.output else []) + self._close(status):
            yield event
        self.final = self.response(status, self.output, response_usage(run.usage()))
        await self.save()
        yield {"type": f"response.{status}", "response": self.final}

    def _added(self, item: dict) -> dict:
        self._open = item
        self.output.append(item)
        return {"type": "response.output_item.added", "output_index": len(self.output) - 1,
                "item": {**item, "content": []} if item["type"] == "message" else dict(item)}

    def _text(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close("completed")
            item = message_item("", "in_progress")
            events.append(self._added(item))
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.output) - 1, "content_index": 0,
                           "part": _text_part("")})
        assert self._open is not None
        self._open["content"][0]["text"] += text
        if text:
            events.append({"type": "response.output_text.delta", "item_id": self._open["id"],
                           "output_index": len(self.output) - 1, "content_index": 0,
                           "delta": text, "logprobs": []})
        return events

    def _call(self, call: dict) -> list[dict]:
        events = []
        function = call.get("function") or {}
        item = self._calls.get(call["index"])
        if item is None:
            events += self._close("completed")
            item = self._calls[call["index"]] = function_call_item(
                call.get("id") or "", function.get("name") or "", "", "in_progress")
            events.append(self._added(item))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append({"type": "response.function_call_arguments.delta",
                           "item_id": item["id"], "output_index": self.output.index(item),
                           "delta": function["arguments"]})
        return events

    def _close(self, status: str) -> list[dict]:
        """The `done` events of the open output item (none when none is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [{"type": "response.output_text.done", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "text": part["text"],
                       "logprobs": []},
                      {"type": "response.content_part.done", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "part": dict(part)}]
        else:
            events = [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                       "output_index": index, "name": item["name"],
                       "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": json.loads(json.dumps(item))})
        return events
