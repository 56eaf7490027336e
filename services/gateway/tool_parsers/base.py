"""What every tool-call parser shares: the call, its ids, the parser's contract, and the
stream machinery of formats that write each call as JSON (llama3_json, mistral).

A parser turns the model's answer into OpenAI `tool_calls` two ways that agree:

    extract_tool_calls(text)  the whole answer -> (content or None, [ToolCall])
    stream().feed(delta)...   text deltas -> chat deltas ({"content"} or {"tool_calls"}),
    stream().finish()         whose arguments add up to exactly the whole answer's

and says how a forced tool_choice (`required`, a named function) is written, as an
xgrammar structural tag whose calls it parses back (services/gateway/tools.py).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

if TYPE_CHECKING:
    from pdserve.services.gateway.tools import Tool

NAME = r"([a-zA-Z0-9_-]{1,64})"
"""An OpenAI function name, as the group of a header regex."""


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallStream(Protocol):
    num_calls: int
    """Calls handed out so far (a stream that made any ends with finish_reason tool_calls)."""

    def feed(self, text: str) -> list[dict]: ...

    def finish(self) -> list[dict]: ...


class ToolParser:
    """One format of tool calls (`--tool-call-parser NAME`). Stateless: one per server."""

    name: ClassVar[str]
    skip_special_tokens: ClassVar[bool] = True
    """False where the markup is a special token the detokenizer must keep (mistral's
    [TOOL_CALLS], as vLLM's adjust_request)."""
    prefix: ClassVar[str] = ""
    """Forced calls: text before the first call (mistral's "[TOOL_CALLS][")."""
    separator: ClassVar[str] = ""
    suffix: ClassVar[str] = ""

    def stream(self) -> ToolCallStream:
        raise NotImplementedError

    def call_tag(self, tool: Tool) -> dict:
        """The xgrammar tag of one forced call of `tool`, arguments held to its schema."""
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a whole answer; (text, []) when it holds no call or
        a malformed one. This default runs the stream over the whole answer, so both agree
        by construction."""
        stream = self.stream()
        content, calls = assemble(stream.feed(text) + stream.finish())
        if not calls or getattr(stream, "in_call", False):
            return text, []
        for call in calls:
            try:
                json.loads(call.arguments)
            except json.JSONDecodeError:
                return text, []
        return content.rstrip() or None, calls

    def forced_format(self, tools: Sequence[Tool], named: str | None, parallel: bool) -> dict:
        """The structural tag format of a forced tool_choice: exactly one call of `named`,
        or (`required`) one or more calls of `tools` (one, unless `parallel`)."""
        if named is not None:
            body = self.call_tag(next(t for t in tools if t.name == named))
        else:
            body = {"type": "tags_with_separator", "tags": [self.call_tag(t) for t in tools],
                    "separator": self.separator, "at_least_one": True,
                    "stop_after_first": not parallel}
        if not self.prefix and not self.suffix:
            return body
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": self.prefix}, body,
            {"type": "const_string", "value": self.suffix}]}


def json_call_tag(tool: Tool, args_key: str) -> dict:
    """The tag of a forced call written `{"name": "F", "<args_key>": {...}}`."""
    return {"type": "tag", "begin": f'{{"name": "{tool.name}", "{args_key}": ',
            "content": {"type": "json_schema", "json_schema": tool.parameters}, "end": "}"}


def assemble(pieces: list[dict]) -> tuple[str, list[ToolCall]]:
    """(content, calls) that a stream's chat deltas add up to."""
    content, calls = "", {}
    for piece in pieces:
        content += piece.get("content", "")
        for d in piece.get("tool_calls", []):
            call = calls.setdefault(d["index"], ["", "", ""])
            call[0] = d.get("id", call[0])
            call[1] += d.get("function", {}).get("name", "")
            call[2] += d.get("function", {}).get("arguments", "")
    return content, [ToolCall(*calls[i]) for i in sorted(calls)]


class JsonScanner:
    """Finds where the JSON object or array opening at text[0] closes, text fed as it
    grows: each character is read once (brackets inside strings do not count)."""

    def __init__(self) -> None:
        self._pos, self._depth, self._in_string, self._escaped = 0, 0, False, False
        self._end: int | None = None

    def end(self, text: str) -> int | None:
        """The index just past the closing bracket, or None while it is still open."""
        if self._end is not None:
            return self._end
        for i in range(self._pos, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end = i + 1
                    return self._end
        self._pos = len(text)
        return None


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


_OBJECT_START = re.compile(r'\{\s*(?:"|$)')
"""An object that may be a call: its first key starts (or nothing follows the "{" yet)."""


class JsonCallStream:
    """Streams calls written as JSON objects; subclasses say where calls start and what
    separates them (`_step`).

    A call object whose head is canonical, `{"name": "F", "<args key>": {`, is handed out
    at once (id and name), then its arguments as the model writes them: their text is
    the model's own, from their "{" to its matching "}". Any other object is held until it
    closes, then parsed whole (keys in another order: a call whose arguments are
    re-serialized, sent in one delta), or handed out as content when it is not a call.
    """

    header: ClassVar[re.Pattern]
    """Matches a canonical call head, group 1 the name, ending just before the arguments."""
    args_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def __init__(self) -> None:
        self._buffer = ""
        """Text not handed out yet."""
        self._object: JsonScanner | None = None
        """The object at the buffer's start, while it is read."""
        self._args_at: int | None = None
        """Where the current call's arguments start in the buffer, once its head was sent."""
        self._args: JsonScanner | None = None
        """The current call's arguments (from `_args_at`)."""
        self._sent = 0
        """Characters of the current call's arguments sent."""
        self.num_calls = 0

    @property
    def in_call(self) -> bool:
        """A call's head was sent and the call has not closed."""
        return self._args_at is not None

    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        out: list[dict] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[dict]:
        """Held-back text, at the end of the answer (a call cut short has sent all it had)."""
        out: list[dict] = []
        if not self.in_call:
            self._content(out, self._buffer)
        self._buffer = ""
        return out

    def _step(self, out: list[dict]) -> bool:
        """Hand out what the buffer allows; True when it changed state (step again)."""
        raise NotImplementedError

    def new_id(self) -> str:
        return new_call_id()

    def _content(self, out: list[dict], text: str) -> None:
        """Content, except whitespace between or after calls."""
        if text and not (self.num_calls and not text.strip()):
            out.append({"content": text})

    def _open_call(self, out: list[dict], name: str, arguments: str = "") -> None:
        out.append({"tool_calls": [{"index": self.num_calls, "id": self.new_id(),
                                    "type": "function",
                                    "function": {"name": name, "arguments": arguments}}]})
        self.num_calls += 1

    def _start_args(self, at: int) -> None:
        """The current call's arguments open at buffer[at]."""
        self._args_at, self._args, self._sent = at, JsonScanner(), 0

    def _stream_args(self, out: list[dict]) -> int | None:
        """Send the current call's arguments as far as they are written; the index past
        them (in the buffer) once they closed, else None."""
        at = self._args_at
        assert at is not None and self._args is not None
        end = self._args.end(self._buffer[at:])
        arguments = self._buffer[at:] if end is None else self._buffer[at:at + end]
        if len(arguments) > self._sent:
            out.append({"tool_calls": [{"index": self.num_calls - 1,
                                        "function": {"arguments": arguments[self._sent:]}}]})
            self._sent = len(arguments)
        return None if end is None else at + end

    def _read_object(self, out: list[dict]) -> tuple[int, bool] | None:
        """The buffer starts with "{": hand out the call it opens. Returns (the characters
        it took, whether they were a call), once the call closed or a non-call went out as
        content; None: wait for more."""
        buffer = self._buffer
        if self._object is None:
            self._object = JsonScanner()
        if self._args_at is None:
            head = self.header.match(buffer)
            if head is not None:
                self._open_call(out, head.group(1))
                self._start_args(head.end())
            elif not _OBJECT_START.match(buffer):
                self._content(out, "{")
                self._object = None
                return 1, False
            else:
                end = self._object.end(buffer)
                if end is None:
                    return None
                parsed = self._parse_call(buffer[:end])
                if parsed is None:
                    self._content(out, buffer[:end])
                else:
                    self._open_call(out, *parsed)
                self._object = None
                return end, parsed is not None
        if self._stream_args(out) is None:
            return None
        end = self._object.end(buffer)  # the call object's own end, after any other keys
        if end is None:
            return None
        self._object = self._args_at = self._args = None
        return end, True

    def _step_object(self, out: list[dict]) -> bool:
        """The buffer starts with a call's "{": on to state "after" once the call closed,
        "text" once it went out as content (a subclass's `_state`)."""
        read = self._read_object(out)
        if read is None:
            return False
        self._buffer = self._buffer[read[0]:]
        self._state = "after" if read[1] else "text"
        return True

    def _parse_call(self, text: str) -> tuple[str, str] | None:
        """(name, arguments) of a call object in any key order; None when not a call."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = next((value[k] for k in self.args_keys if k in value), None)
        if not isinstance(arguments, dict):
            return None
        return value["name"], json.dumps(arguments, ensure_ascii=False)
