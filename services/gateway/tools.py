"""OpenAI tools on the chat endpoint: validate `tools`, resolve `tool_choice`, constrain.

    tool_choice   what the model may write                     how
    none          text (the tools still go into the prompt)    unconstrained
    auto          text and/or tool-call markup                 unconstrained, parsed after
                  (needs --enable-auto-tool-choice --tool-call-parser NAME, as vLLM)
    required      one or more tool calls, nothing else         structural tag (below)
    {"type": "function", "function": {"name": F}}
                  exactly one call of F                        structural tag (below)

Every forced call is written in the markup of the server's parser (services/gateway/
tool_parsers/; hermes when --tool-call-parser is not set), which its template shows the
model, the arguments held to the function's parameters schema by the grammar (so they
always validate). With hermes:

    <tool_call>\\n{"name": "F", "arguments": <JSON of F's parameters schema>}\\n</tool_call>

(several calls, with `required`, back to back). Responses parse that markup back with the
same parser, for `auto` as for the forced modes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pdserve.services.gateway.errors import bad_request
from pdserve.services.gateway.protocol import ChatCompletionRequest
from pdserve.services.gateway.tool_parsers import ToolParser, get_tool_parser
from pdserve.shared.structured_output.params import StructuredOutputsParams, canonical_json

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict
    """The function's parameters JSON schema (an empty object schema when not given)."""


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a chat request uses its tools."""

    tools: tuple[Tool, ...]
    choice: str
    """"none", "auto", "required", or "named"."""
    named: str | None = None
    """The function a named tool_choice forces."""
    parallel: bool = True
    """`required` may make several calls (OpenAI's parallel_tool_calls)."""
    parser: ToolParser = get_tool_parser(None)
    """Writes the forced calls and reads the answer's calls (--tool-call-parser)."""

    @property
    def parses_calls(self) -> bool:
        """The answer's tool-call markup becomes `tool_calls`."""
        return self.choice != "none"

    @property
    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar of the forced modes (required, named); None otherwise."""
        if self.choice not in ("required", "named"):
            return None
        fmt = self.parser.forced_format(self.tools, self.named, self.parallel)
        return StructuredOutputsParams(structural_tag=canonical_json(
            {"type": "structural_tag", "format": fmt}))


def parse_tools(tools: list) -> tuple[Tool, ...]:
    """The request's `tools` ([{"type": "function", "function": {...}}]), checked.

    Raises:
        GatewayError: 400 naming `tools` (a bad entry, name or parameters schema).
    """
    out: list[Tool] = []
    for i, entry in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(entry, dict) or entry.get("type", "function") != "function" or \
                not isinstance(entry.get("function"), dict):
            raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}",
                              "tools")
        function = entry["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(f"{where}.function.name must match [a-zA-Z0-9_-]{{1,64}}, got "
                              f"{name!r}", "tools")
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                              "tools")
        if any(t.name == name for t in out):
            raise bad_request(f"{where}.function.name {name!r} is given twice", "tools")
        out.append(Tool(name, parameters))
    return tuple(out)


def resolve_tool_mode(req: ChatCompletionRequest, *, enable_auto_tool_choice: bool,
                      template_renders_tools: bool,
                      parser: ToolParser | None = None) -> ToolMode | None:
    """How `req` uses tools; None when it has none. `parser`: the server's (default hermes).

    Raises:
        GatewayError: 400 naming `tools` or `tool_choice`.
    """
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    tools = parse_tools(req.tools)
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    named = None
    if isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(named, str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if all(t.name != named for t in tools):
            raise bad_request(f"tool_choice names the function {named!r}, which is not in "
                              "tools", "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named "
                          f"function, got {choice!r}", "tool_choice")
    if choice == "auto" and not enable_auto_tool_choice:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                          "--tool-call-parser to be set", "tool_choice")
    if not template_renders_tools:
        raise bad_request("the chat template cannot render tools; start the server with a "
                          "tool template, e.g. --chat-template "
                          "tool_chat_template_smollm2_hermes.jinja", "tools")
    return ToolMode(tools, choice, named, req.parallel_tool_calls is not False,
                    parser or get_tool_parser(None))


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The conversation for the chat template: assistant tool calls with their arguments
    as objects (templates write them as JSON), tool results with their call id.

    Raises:
        GatewayError: 400 naming `messages` (arguments that are not a JSON object).
    """
    out = []
    for i, m in enumerate(req.messages):
        message: dict = {"role": m.role, "content": m.text()}
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [_template_call(call, f"messages.{i}.tool_calls.{j}")
                                     for j, call in enumerate(m.tool_calls)]
        out.append(message)
    return out


def _template_call(call: object, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{'name': ..., "
                          "'arguments': ...}}", "messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise bad_request(f"{where}.function.arguments is not valid JSON",
                              "messages") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object", "messages")
    return {"id": call.get("id"), "type": "function",  # type: ignore[union-attr]
            "function": {"name": function["name"], "arguments": arguments}}
