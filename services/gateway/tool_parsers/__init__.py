"""Tool-call parsers by `--tool-call-parser` name (vLLM's names), chosen once at start-up.

    hermes        <tool_call>{"name": ..., "arguments": ...}</tool_call>   (Qwen, Hermes, SmolLM2)
    llama3_json   <|python_tag|>{"name": ..., "parameters": ...}; ...      (Llama 3.x)
    mistral       [TOOL_CALLS][{"name": ..., "arguments": ...}]            (Mistral)
                  [TOOL_CALLS]name[ARGS]{...}

The contract they share is in base.py.
"""

from __future__ import annotations

from pdserve.services.gateway.tool_parsers.base import ToolCall, ToolCallStream, ToolParser
from pdserve.services.gateway.tool_parsers.hermes import HermesToolParser
from pdserve.services.gateway.tool_parsers.llama3_json import Llama3JsonToolParser
from pdserve.services.gateway.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HermesToolParser(), Llama3JsonToolParser(), MistralToolParser())}
DEFAULT_TOOL_PARSER = "hermes"
"""Reads forced calls (tool_choice required or named) when no --tool-call-parser is set."""

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallStream", "ToolParser", "check_tool_call_parser",
           "get_tool_parser"]


def check_tool_call_parser(name: str | None) -> None:
    """Raises: ValueError, one line naming the flag and the parsers there are."""
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, "
                         f"got {name!r}")


def get_tool_parser(name: str | None) -> ToolParser:
    """The parser of `--tool-call-parser` (hermes when not set). Raises: ValueError."""
    check_tool_call_parser(name)
    return TOOL_PARSERS[name or DEFAULT_TOOL_PARSER]
