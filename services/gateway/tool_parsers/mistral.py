"""Mistral tool calls (`--tool-call-parser mistral`, vLLM's name), both forms:

    Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{...}

(the JSON array of tokenizers before v11; then `name[ARGS]{arguments}` per call, the
[ARGS] absent in v11) are content "Sure." and the calls. Call ids are 9 alphanumeric
characters, as Mistral's own validator requires of the ids sent back in later turns.
[TOOL_CALLS] is a special token of Mistral's tokenizers: with tools, the answer is
detokenized keeping special tokens (`skip_special_tokens`, as vLLM's adjust_request).

Forced calls (tool_choice `required` or named) are written in the array form,
`[TOOL_CALLS] [{...}, {...}]`, as chat_templates/tool_chat_template_mistral.jinja renders
past calls (and v0.3's tokenizer encodes them).
NOTE: the grammar spells "[TOOL_CALLS]" as text: where the tokenizer has it as one special
token, the model writes it in ordinary tokens, and the answer reads the same.
"""

from __future__ import annotations

import re
import secrets
import string
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

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits
_NAMED_CALL = re.compile(NAME + r"\s*(?:" + re.escape(ARGS) + r"\s*)?(?=\{)")
"""The v11+ form's call head: the name, then [ARGS] (v13) or not (v11), then the object."""
_NAME_SO_FAR = re.compile(NAME + r"\s*(?:\[(?:A(?:R(?:G(?:S\]?)?)?)?)?)?\s*")
"""A head of that form still being written."""


class MistralStream(JsonCallStream):
    header = re.compile(r'\{\s*"name"\s*:\s*"' + NAME + r'"\s*,\s*"arguments"\s*:\s*(?=\{)')

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"
        """text: content, looking for [TOOL_CALLS]; open: the buffer starts with it;
        item: in the array, before a call or "]"; object: the buffer starts with the
        array's next call; after: a call of the array closed (",", "]"); args: a named
        call's arguments."""

    def new_id(self) -> str:
        """9 alphanumeric characters, as mistral-common validates tool call ids."""
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def _step(self, out: list[dict]) -> bool:
        steps = {"text": self._step_text, "open": self._step_open,
                 "item": lambda out: self._step_in_array("{", "object", keep=True),
                 "object": self._step_object,
                 "after": lambda out: self._step_in_array(",", "item", keep=False),
                 "args": self._step_args}
        return steps[self._state](out)

    def _step_text(self, out: list[dict]) -> bool:
        start = self._buffer.find(BOT)
        if start < 0:
            keep = partial_suffix(self._buffer, BOT)
            self._content(out, self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._content(out, self._buffer[:start])
        self._buffer, self._state = self._buffer[start:], "open"
        return True

    def _step_open(self, out: list[dict]) -> bool:
        rest = self._buffer[len(BOT):].lstrip()
        if not rest:
            return False
        if rest[0] == "[":
            self._buffer, self._state = rest[1:], "item"
            return True
        head = _NAMED_CALL.match(rest)
        if head is not None:
            self._open_call(out, head.group(1))
            self._buffer, self._state = rest[head.end():], "args"
            self._start_args(0)
            return True
        if _NAME_SO_FAR.fullmatch(rest):
            return False  # the name, or its [ARGS], is still being written
        self._content(out, BOT)  # not a call after all: content, and on after it
        self._buffer, self._state = self._buffer[len(BOT):], "text"
        return True

    def _step_in_array(self, expected: str, then: str, keep: bool) -> bool:
        """In the array: `expected` (kept in the buffer when `keep`) goes on to state `then`,
        "]" ends the array; anything else is text."""
        rest = self._buffer.lstrip()
        if not rest:
            return False
        if rest[0] == expected:
            self._buffer, self._state = rest if keep else rest[1:], then
        elif rest[0] == "]":
            self._buffer, self._state = rest[1:], "text"
        else:
            self._state = "text"
        return True

    def _step_args(self, out: list[dict]) -> bool:
        end = self._stream_args(out)
        if end is None:
            return False
        self._args_at = self._args = None
        self._buffer, self._state = self._buffer[end:], "text"
        return True


class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False
    prefix, separator, suffix = BOT + " [", ", ", "]"

    def stream(self) -> MistralStream:
        return MistralStream()

    def call_tag(self, tool: Tool) -> dict:
        return json_call_tag(tool, "arguments")
