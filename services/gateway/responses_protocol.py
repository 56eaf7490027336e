"""The Responses API request (POST /v1/responses): its model, its refusals, and its
translation into the chat request that serves it (services/gateway/serving_responses.py).

    instructions                       -> a system message first (this turn's only: OpenAI
                                          does not carry a previous response's over)
    previous turns (the stored chain)  -> their input items, then their output items
    input: "text"                      -> a user message
    input items
      {"type": "message", role, content: str | [input_text | output_text parts]}
                                       -> a message of that role
      {"type": "function_call", call_id, name, arguments}
                                       -> an assistant message's tool_calls (consecutive
                                          calls join one message)
      {"type": "function_call_output", call_id, output}
                                       -> a tool message answering call_id
    max_output_tokens                  -> max_completion_tokens
    tools [{"type": "function", name, parameters, ...}]
                                       -> tools [{"type": "function", "function": {...}}]
    tool_choice {"type": "function", "name": F}
                                       -> {"type": "function", "function": {"name": F}}
    text.format json_schema / json_object
                                       -> response_format (structured_outputs.py)

As for chat (protocol.py): fields neither OpenAI's nor vLLM's Responses schema names are
accepted and ignored; the ones pdserve does not implement (background mode, built-in tools,
`include`, `reasoning`, `conversation`, prompt templates, ...) are a 400 naming the field
when set to anything with an effect.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationError

from pdserve.services.gateway.errors import bad_request
from pdserve.services.gateway.protocol import (
    ChatCompletionRequest,
    NullMeansDefault,
    check_not_implemented,
)

BUILT_IN_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26",
    "web_search_preview_2025_03_11", "file_search", "code_interpreter", "computer_use",
    "computer_use_preview", "image_generation", "mcp", "local_shell", "shell", "custom",
    "apply_patch"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_MEDIA_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_NO_EFFECT: dict[str, tuple] = {
    "include": (None, []), "conversation": (None,), "prompt": (None,),
    "max_tool_calls": (None,), "truncation": (None, "disabled"), "top_logprobs": (None, 0),
    "mm_processor_kwargs": (None,), "enable_response_messages": (None, False),
    "previous_input_messages": (None,), "prompt_cache_retention": (None,),
}
"""Fields of OpenAI's or vLLM's Responses request pdserve does not implement, with the
values that have no effect: anything else is a 400 naming the field."""


class ResponsesRequest(NullMeansDefault):
    """POST /v1/responses (OpenAI's fields, and vLLM's extras pdserve serves)."""

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """vLLM's."""
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    """{"format": {"type": "text" | "json_object" | "json_schema", ...}}."""
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    background: bool | None = False
    reasoning: dict | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    logit_bias: dict[str, float] | None = None
    request_id: str | None = None
    """vLLM's: the response's id (default: a fresh resp_<hex>)."""
    cache_salt: str | None = None
    priority: int = 0
    skip_special_tokens: bool = True


def check_responses_request(req: ResponsesRequest) -> None:
    """Refuse what pdserve does not serve, naming the field.

    Raises:
        GatewayError: 400 naming the first such field.
    """
    check_not_implemented(req, _NO_EFFECT)
    if req.background:
        raise bad_request("background mode is not supported by pdserve", "background")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise bad_request("reasoning is not supported by this model (it has no reasoning "
                          "parser)", "reasoning")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be at least 1, got {req.max_output_tokens}",
                          "max_output_tokens")
    if isinstance(req.input, str) and not req.input and req.previous_response_id is None:
        raise bad_request("input must not be empty", "input")


def chat_tools(tools: list[dict]) -> list[dict]:
    """Responses function tools in chat's shape; built-in tools are refused (400 `tools`)."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind in BUILT_IN_TOOLS:
            raise bad_request(f"tools.{i}: the built-in tool {kind!r} is not supported by "
                              "pdserve; only function tools are", "tools")
        if kind != "function":
            raise bad_request(f"tools.{i}.type must be 'function', got {kind!r}", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """Responses' tool_choice in chat's shape (400 `tool_choice` for built-in choices)."""
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice {choice!r} is not supported: give 'none', 'auto', "
                      "'required' or {'type': 'function', 'name': ...}", "tool_choice")


def response_format(text: dict | None) -> dict | None:
    """`text.format` as chat's response_format (None: plain text)."""
    if not text or text.get("format") is None:
        return None
    fmt = text["format"]
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt["schema"],
            "strict": bool(fmt.get("strict"))}}
    raise bad_request("text.format.type must be 'text', 'json_object' or 'json_schema', got "
                      f"{kind!r}", "text")


def input_items(value: str | list[dict]) -> list[dict]:
    """The request's input as items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": value}]}]
    return list(value)


def _text_content(content: object, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise bad_request(f"{_MEDIA_PARTS[kind]} input is not supported by this model "
                              f"({where}.content.{j} has type {kind!r})", "input")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content.{j} must be an input_text or output_text part "
                              f"with a text, got type {kind!r}", "input")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Responses items -> chat messages (the table in the module docstring).

    Raises:
        GatewayError: 400 naming `input` (an item pdserve cannot render).
    """
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}",
                                  "input")
            messages.append({"role": role,
                             "content": _text_content(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # its text, then calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id is required", "input")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_content(output, where) if output is not None
                             else ""})
        elif kind == "reasoning":
            continue  # this model writes none; another's is not shown to it (as vLLM)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported by "
                              "pdserve", "input")
    return messages


def _function_call(item: dict, where: str) -> dict:
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str):
            raise bad_request(f"{where}.{field} must be a string", "input")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def to_chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat request that serves `req` after the stored turns `history` (their items).

    Raises:
        GatewayError: 400 naming the Responses field at fault.
    """
    body: dict = {
        "messages": chat_messages(history + input_items(req.input), req.instructions),
        "stream": bool(req.stream), "priority": req.priority,
        "skip_special_tokens": req.skip_special_tokens}
    for name, value in (("model", req.model), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("top_k", req.top_k),
                        ("max_completion_tokens", req.max_output_tokens),
                        ("logit_bias", req.logit_bias), ("cache_salt", req.cache_salt),
                        ("user", req.user), ("parallel_tool_calls", req.parallel_tool_calls),
                        ("response_format", response_format(req.text))):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    if req.tool_choice is not None and (req.tools or req.tool_choice not in ("auto", "none")):
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        raise bad_request(f"Invalid input: {err['msg']} at "
                          f"{'.'.join(map(str, err['loc']))}", "input") from None
