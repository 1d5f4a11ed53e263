"""One chat choice's text -> OpenAI message parts: reasoning, content, tool calls.

The detokenized text (special tokens kept, so that markers reach the parsers) goes through
the reasoning parser, then the content through the tool parser; special tokens nobody claimed
(EOS, role markers) are dropped from what the client sees. Streams use eager tool parsers
(argument deltas as generated); a whole message uses buffered ones (malformed calls come back
as content text). `max_calls` (1 for `parallel_tool_calls: false`) drops the calls past it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kdaserve.server.reasoning import ReasoningParser
from kdaserve.server.tool_parsers.base import MarkerLexer, ToolCallDelta, ToolParser, collect


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 specials: Iterable[str] = (), max_calls: int | None = None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls
        claimed = set(tools.markers if tools else ())
        drop = [s for s in specials if s not in claimed]
        self._strip_content = MarkerLexer(drop) if drop else None
        self._strip_reasoning = MarkerLexer(drop) if drop else None
        self.num_calls = 0

    def feed(self, text: str) -> ChatDelta:
        return self._route(self.reasoning.feed(text) if self.reasoning else [(False, text)],
                           final=False)

    def finish(self) -> ChatDelta:
        pieces = self.reasoning.finish() if self.reasoning else []
        return self._route(pieces, final=True)

    def _route(self, pieces: list[tuple[bool, str]], final: bool) -> ChatDelta:
        out = ChatDelta()
        content = []
        for is_reasoning, text in pieces:
            if is_reasoning:
                out.reasoning += self._strip(self._strip_reasoning, text)
            elif self.tools is None:
                content.append(text)
            else:
                for e in self.tools.feed(text):
                    content.append(e) if isinstance(e, str) else out.calls.append(e)
        if final:
            if self.tools is not None:
                for e in self.tools.finish():
                    content.append(e) if isinstance(e, str) else out.calls.append(e)
            out.reasoning += self._strip(self._strip_reasoning, "", flush=True)
        out.content = self._strip(self._strip_content, "".join(content), flush=final)
        if self.max_calls is not None:
            out.calls = [c for c in out.calls if c.index < self.max_calls]
        self.num_calls = max([self.num_calls] + [c.index + 1 for c in out.calls])
        return out

    @staticmethod
    def _strip(lexer: MarkerLexer | None, text: str, flush: bool = False) -> str:
        if lexer is None:
            return text
        pieces = lexer.feed(text) + (lexer.flush() if flush else [])
        return "".join(t for is_marker, t in pieces if not is_marker)

    def whole(self, text: str) -> tuple[str, str, list]:
        """(reasoning, content, tool calls) of a complete message."""
        a, b = self.feed(text), self.finish()
        msg = collect([*a.calls, *b.calls])
        return a.reasoning + b.reasoning, a.content + b.content, msg.tool_calls
