"""Hermes tool-call markup -> OpenAI `tool_calls`, for a whole answer or a stream of deltas.

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

is content "Let me look." and one call, get_weather with arguments '{"city": "Paris"}'.
The arguments string is the model's own text between `"arguments": ` and the closing `}`,
so a stream's argument deltas add up to exactly the non-streamed string. A call whose body
is JSON in another shape ("arguments" first, "parameters") is parsed as JSON instead: its
arguments are re-serialized, and a stream sends them in one delta when the call closes.
Forced calls (tool_choice `required` or named) are written in this markup, back to back,
as chat_templates/tool_chat_template_smollm2_hermes.jinja shows the model.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from pdserve.services.gateway.tool_parsers.base import (
    ToolCall,
    ToolParser,
    new_call_id,
    partial_suffix,
)

if TYPE_CHECKING:
    from pdserve.services.gateway.tools import Tool

START, END = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]+)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_CALL = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.S)
_END_PREFIXES = "|".join(re.escape(END[:n]) for n in range(len(END), 0, -1))
_CLOSING_TAIL = re.compile(r"\}\s*(?:" + _END_PREFIXES + ")?$")
"""A `}` that may close the call: followed only by whitespace and a prefix of END."""
CALL_BEGIN = '<tool_call>\n{"name": "%s", "arguments": '
CALL_END = "}\n</tool_call>"


def _parse_body(body: str) -> tuple[str, str] | None:
    """(name, arguments text) of one call's body, or None when it is not a call."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    header = _HEADER.match(body)
    if header is not None and isinstance(arguments, dict):
        return value["name"], _raw_arguments(body[header.end():])
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _raw_arguments(rest: str) -> str:
    """The arguments text of a canonical body's tail (`<arguments>}` plus whitespace)."""
    return rest.rstrip().removesuffix("}").rstrip()


def extract_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the first call or None, calls) of a whole answer; (text, []) when it
    holds no well-formed call."""
    start = text.find(START)
    calls = []
    for body in _CALL.findall(text):
        parsed = _parse_body(body)
        if parsed is None:
            return text, []
        calls.append(ToolCall(new_call_id(), *parsed))
    if not calls:
        return text, []
    return text[:start].rstrip() or None, calls


class HermesStream:
    """Turns one choice's text deltas into OpenAI chat deltas (content or tool_calls)."""

    def __init__(self) -> None:
        self._buffer = ""
        """Text not handed out yet: a possible START prefix, or the current call's body."""
        self._in_call = False
        self._streaming_args = False
        """The current call's header was sent; its arguments go out as they come."""
        self._sent = 0
        """Characters of the current call's arguments sent."""
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        out: list[dict] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(START)
                if start < 0:
                    keep = partial_suffix(self._buffer, START)
                    content = self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(content):]
                    if content and not (self.num_calls and not content.strip()):
                        out.append({"content": content})
                    return out
                if self._buffer[:start] and not (self.num_calls
                                                 and not self._buffer[:start].strip()):
                    out.append({"content": self._buffer[:start]})
                self._buffer = self._buffer[start + len(START):]
                self._in_call, self._streaming_args, self._sent = True, False, 0
            if not self._step_call(out):
                return out

    def finish(self) -> list[dict]:
        """What the buffer still holds, at the end of the answer: held-back content, or the
        rest of a call's arguments that never closed (a length cut)."""
        out: list[dict] = []
        if not self._in_call:
            if self._buffer.strip() or (self._buffer and not self.num_calls):
                out.append({"content": self._buffer})
        elif self._streaming_args and len(self._buffer.rstrip()) > self._sent:
            out.append({"tool_calls": [{"index": self.num_calls, "function": {
                "arguments": self._buffer.rstrip()[self._sent:]}}]})
        self._buffer = ""
        return out

    def _step_call(self, out: list[dict]) -> bool:
        """Hand out what the current call allows; True when it closed (go on with text)."""
        index = self.num_calls
        end = self._buffer.find(END)
        body = self._buffer if end < 0 else self._buffer[:end]
        if not self._streaming_args:
            header = _HEADER.match(body)
            if header is not None:
                out.append({"tool_calls": [{"index": index, "id": new_call_id(),
                                            "type": "function",
                                            "function": {"name": header.group(1),
                                                         "arguments": ""}}]})
                self._streaming_args = True
                self._buffer = self._buffer[header.end():]
                return self._step_call(out)
            if end < 0:
                return False  # wait for the header, or for the call's end
            parsed = _parse_body(body)
            self._buffer = self._buffer[end + len(END):]
            self._in_call = False
            if parsed is not None:
                out.append({"tool_calls": [{"index": index, "id": new_call_id(),
                                            "type": "function",
                                            "function": {"name": parsed[0],
                                                         "arguments": parsed[1]}}]})
                self.num_calls += 1
            return True
        if end >= 0:
            arguments = _raw_arguments(body)
        else:
            tail = _CLOSING_TAIL.search(body)
            arguments = body[:tail.start()] if tail is not None else body.rstrip()
        if len(arguments) > self._sent:
            out.append({"tool_calls": [{"index": index,
                                        "function": {"arguments": arguments[self._sent:]}}]})
            self._sent = len(arguments)
        if end < 0:
            return False
        self._buffer = self._buffer[end + len(END):]
        self._in_call = False
        self.num_calls += 1
        return True


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> HermesStream:
        return HermesStream()

    def call_tag(self, tool: Tool) -> dict:
        # NOTE: no separator between forced calls: after "</tool_call>" the model's own
        # next token is "\n" far more often than its end of turn, and a "\n" separator let
        # a small model chain calls until max_tokens.
        return {"type": "tag", "begin": CALL_BEGIN % tool.name,
                "content": {"type": "json_schema", "json_schema": tool.parameters},
                "end": CALL_END}

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return extract_tool_calls(text)
