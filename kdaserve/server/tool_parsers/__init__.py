"""Tool-call parsers by name (`--tool-call-parser`): text the model writes -> OpenAI tool calls.
See base.py for the contract; json_calls.py is the format constrained decoding forces for
`tool_choice` "required" or a named function, whatever the model."""

from __future__ import annotations

from kdaserve.server.tool_parsers.base import (
    MarkerLexer,
    ParsedMessage,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    collect,
)
from kdaserve.server.tool_parsers.json_calls import JsonCallsParser, call_grammar
from kdaserve.server.tool_parsers.kimi_k2 import KimiK2ToolParser
from kdaserve.server.tool_parsers.kimi_k3 import KimiK3ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    KimiK3ToolParser.name: KimiK3ToolParser,
    KimiK2ToolParser.name: KimiK2ToolParser,
}

__all__ = ["TOOL_PARSERS", "JsonCallsParser", "KimiK2ToolParser", "KimiK3ToolParser",
           "MarkerLexer", "ParsedMessage", "ToolCall", "ToolCallDelta", "ToolParser",
           "call_grammar", "collect"]
