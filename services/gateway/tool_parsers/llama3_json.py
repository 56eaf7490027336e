"""Llama 3.x JSON tool calls (`--tool-call-parser llama3_json`, vLLM's name).

    Let me look.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {...}

is content "Let me look." and the calls, separated by ";". The <|python_tag|> is optional
(a special token, usually skipped by the detokenizer); "arguments" may stand for
"parameters". An answer with no such object is content, and so is an object that is not a
call. Llama 3.1's JSON tool template (chat_templates/tool_chat_template_llama3.1_json.jinja)
asks for this format; forced calls are written in it, back to back with "; ".
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pdserve.services.gateway.tool_parsers.base import (
    NAME,
    JsonCallStream,
    ToolParser,
    json_call_tag,
    partial_suffix,
)

if TYPE_CHECKING:
    from pdserve.services.gateway.tools import Tool

PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*;\s*")


class Llama3JsonStream(JsonCallStream):
    header = re.compile(r'\{\s*"name"\s*:\s*"' + NAME +
                        r'"\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)')
    args_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"
        """text: content, looking for a call; object: the buffer starts with a call's "{";
        after: a call just closed (a ";" may bring the next)."""

    def _step(self, out: list[dict]) -> bool:
        buffer = self._buffer
        if self._state == "object":
            return self._step_object(out)
        if self._state == "after":
            if not buffer.strip():
                return False  # whitespace: wait for a ";" or the end
            separator = _SEPARATOR.match(buffer)
            if separator is not None and separator.end() == len(buffer):
                return False
            if separator is not None and buffer[separator.end()] == "{":
                self._buffer, self._state = buffer[separator.end():], "object"
            else:
                self._state = "text"
            return True
        brace, tag = buffer.find("{"), buffer.find(PYTHON_TAG)
        if tag >= 0 and (brace < 0 or tag < brace):
            rest = buffer[tag + len(PYTHON_TAG):].lstrip()
            if not rest:
                self._content(out, buffer[:tag])
                self._buffer = buffer[tag:]
                return False
            if rest[0] == "{":
                self._content(out, buffer[:tag])
                self._buffer, self._state = rest, "object"
            else:  # not JSON after the tag (Llama's built-in code tool): content
                self._content(out, buffer[:tag + len(PYTHON_TAG)])
                self._buffer = buffer[tag + len(PYTHON_TAG):]
            return True
        if brace >= 0:
            self._content(out, buffer[:brace])
            self._buffer, self._state = buffer[brace:], "object"
            return True
        keep = partial_suffix(buffer, PYTHON_TAG)
        self._content(out, buffer[:len(buffer) - keep])
        self._buffer = buffer[len(buffer) - keep:]
        return False


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    separator = "; "

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream()

    def call_tag(self, tool: Tool) -> dict:
        return json_call_tag(tool, "parameters")
