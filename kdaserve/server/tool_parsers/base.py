"""What tool-call parsers share: the events they emit, a lexer for streamed markup, and the
streaming contract.

A parser is fed the assistant's text as it is detokenized (special tokens kept) and returns
events: content text, or tool-call deltas (the first delta of a call carries its id and name;
the `arguments` fragments of a call concatenate to its arguments as a JSON string). The same
class runs in two modes: `eager` (streaming: argument deltas as they are generated) and
buffered (a call is released whole when it closes, and a malformed or unfinished call goes
back to the content as the text it was), which is what `parse` uses for a whole message.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class ToolCallDelta:
    index: int                       # which call of the message (0-based)
    arguments: str = ""              # a fragment of the arguments' JSON text
    id: str | None = None            # set on a call's first delta
    name: str | None = None          # set on a call's first delta


Event = "str | ToolCallDelta"        # str: content text


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str                   # JSON text


@dataclass
class ParsedMessage:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class MarkerLexer:
    """Split streamed text into text runs and known markers. A tail that may be the start of a
    marker is held back until the next feed (or `flush`), so a marker split across chunks is
    still found whole."""

    def __init__(self, markers: Iterable[str]) -> None:
        self.markers = sorted(set(m for m in markers if m), key=len, reverse=True)
        self._prefixes = {m[:k] for m in self.markers for k in range(1, len(m))}
        self._longest = max((len(m) for m in self.markers), default=0)
        self._buf = ""

    def feed(self, text: str) -> list[tuple[bool, str]]:
        """(is_marker, text) pieces, in order."""
        buf = self._buf + text
        out: list[tuple[bool, str]] = []
        while buf:
            at, marker = self._first(buf)
            if marker is None:
                break
            if at:
                out.append((False, buf[:at]))
            out.append((True, marker))
            buf = buf[at + len(marker):]
        hold = self._held(buf)
        if len(buf) > hold:
            out.append((False, buf[:len(buf) - hold]))
        self._buf = buf[len(buf) - hold:]
        return out

    def flush(self) -> list[tuple[bool, str]]:
        buf, self._buf = self._buf, ""
        return [(False, buf)] if buf else []

    def _first(self, buf: str) -> tuple[int, str | None]:
        best, found = len(buf), None
        for m in self.markers:       # longest first: a marker that prefixes another loses ties
            i = buf.find(m, 0, best + len(m))
            if i != -1 and i < best:
                best, found = i, m
        return best, found

    def _held(self, buf: str) -> int:
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0


class ToolParser:
    """Base of the registry's parsers; subclasses implement `_on` for lexer pieces."""

    name = ""
    markers: tuple[str, ...] = ()

    def __init__(self, eager: bool = True) -> None:
        self.eager = eager
        self._lexer = MarkerLexer(self.markers)
        self._events: list[str | ToolCallDelta] = []
        self.num_calls = 0

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        for is_marker, piece in self._lexer.feed(text):
            self._on(is_marker, piece)
        return self._take()

    def finish(self) -> list[str | ToolCallDelta]:
        for is_marker, piece in self._lexer.flush():
            self._on(is_marker, piece)
        self._end()
        return self._take()

    @classmethod
    def parse(cls, text: str) -> ParsedMessage:
        """A whole message: content (malformed calls included, as text) and its calls."""
        p = cls(eager=False)
        return collect(p.feed(text) + p.finish())

    # ---- for subclasses ---------------------------------------------------------------------
    def _on(self, is_marker: bool, piece: str) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        """The message ended (an open call is unfinished)."""

    def content(self, text: str) -> None:
        if text:
            self._events.append(text)

    def call_start(self, call_id: str, name: str) -> int:
        index = self.num_calls
        self.num_calls += 1
        self._events.append(ToolCallDelta(index, "", call_id, name))
        return index

    def args(self, index: int, fragment: str) -> None:
        if fragment:
            self._events.append(ToolCallDelta(index, fragment))

    def _take(self) -> list[str | ToolCallDelta]:
        events, self._events = self._events, []
        return events


def collect(events: Iterable[str | ToolCallDelta]) -> ParsedMessage:
    """Fold events into a message (what a client assembling a stream would get)."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for e in events:
        if isinstance(e, str):
            content.append(e)
        elif e.index not in calls:
            calls[e.index] = ToolCall(e.id or "", e.name or "", e.arguments)
        else:
            calls[e.index].arguments += e.arguments
    return ParsedMessage("".join(content), [calls[i] for i in sorted(calls)])
