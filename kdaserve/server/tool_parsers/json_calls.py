"""Tool calls as constrained JSON, for `tool_choice` "required" or a named function.

The grammar (Lark with inline JSON schemas) forces, whatever the model:

    [{"name": "get_weather", "arguments": {...}}, {"name": ..., "arguments": {...}}]

one call for a named function or when parallel_tool_calls is false, one or more otherwise;
each call's arguments match its function's `parameters` schema. Compact separators (", ",
": ") are part of the grammar, so the parser below can find the name and the arguments' end by
scanning.

A call is released, streamed or not, only once its arguments have closed: max_tokens can cut a
call anywhere, and a client must never see (or run) a call whose arguments do not parse. A cut
call is dropped, not turned into content (the finish reason, "length", says the output was
cut); the complete calls before it stay.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from kdaserve.server.tool_parsers.base import ToolParser, new_call_id
from kdaserve.structured.spec import GuidedDecoding

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # OpenAI's rule for function names
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HEAD = re.compile(r'\s*\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')


def _lark_str(text: str) -> str:
    return json.dumps(text)        # names are [A-Za-z0-9_-]: no escapes beyond \"


def call_grammar(functions: Sequence[tuple[str, Any]], parallel: bool) -> GuidedDecoding:
    """functions: (name, parameters schema or None) pairs."""
    rules = []
    alts = []
    for i, (name, params) in enumerate(functions):
        schema = dict(params) if isinstance(params, dict) else {"type": "object"}
        schema["x-guidance"] = _COMPACT
        head = '{"name": "' + name + '", "arguments": '
        rules.append(f"call_{i}: {_lark_str(head)} %json {json.dumps(schema)} \"}}\"")
        alts.append(f"call_{i}")
    calls = 'call ("," " " call)*' if parallel else "call"
    lark = "\n".join([f'start: "[" {calls} "]"', "call: " + " | ".join(alts), *rules])
    # the engine ends the list while max_tokens can close it (structured/list_end.py)
    separator = ', {"name": "' + functions[0][0] + '", "arguments": ' if parallel else ""
    return GuidedDecoding("lark", lark, list_separator=separator)


class JsonCallsParser(ToolParser):
    """Streams the calls of the grammar above; anything else is content."""

    name = "json_calls"

    def __init__(self, eager: bool = True) -> None:
        super().__init__(eager)
        self._buf = ""
        self._state = "start"        # start, head, args, after
        self._text_sent = False
        self._depth = 0
        self._in_str = False
        self._escape = False
        self._args = ""
        self._name = ""
        self._all = ""

    def feed(self, text: str) -> list:
        self._all += text
        self._buf += text
        self._scan()
        return self._take()

    def finish(self) -> list:
        self._scan()
        if self._state == "text":            # not the forced format at all: the text it was
            if not self.eager:
                self._events = [self._all] if self._all else []
        elif self._state == "done" and self._buf.strip():
            self.content(self._buf)
        return self._take()

    def _scan(self) -> None:
        while self._buf:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if not stripped:
                    return
                if stripped[0] != "[":
                    self._state = "text"
                    continue
                self._buf, self._state = stripped[1:], "head"
            elif self._state == "head":
                m = _HEAD.match(self._buf)
                if m is None:
                    if len(self._buf) > 100 or not _could_be_head(self._buf):
                        self._state = "text"
                        continue
                    return
                self._name = m.group(1)
                self._buf, self._state, self._args = self._buf[m.end():], "args", ""
                self._depth, self._in_str, self._escape = 0, False, False
            elif self._state == "args":
                end = self._args_end()
                self._args += self._buf if end < 0 else self._buf[:end]
                if end < 0:
                    self._buf = ""
                    return
                self._buf, self._state = self._buf[end:], "after"
                self.args(self.call_start(new_call_id(), self._name), self._args)
            elif self._state == "after":
                if self._buf.startswith("}, "):
                    self._buf, self._state = self._buf[3:], "head"
                elif self._buf.startswith("}]"):
                    self._buf, self._state = self._buf[2:], "done"
                elif len(self._buf) < 3 and "}, ".startswith(self._buf) or self._buf == "}":
                    return
                else:
                    self._state = "text"
            elif self._state == "done":
                return
            else:                        # "text": not the forced format
                if self.eager:
                    self.content(self._all if self.num_calls == 0 and not self._text_sent
                                 else self._buf)
                    self._text_sent = True
                self._buf = ""
                return

    def _args_end(self) -> int:
        """Index in _buf just past the arguments' closing brace, or -1."""
        for i, ch in enumerate(self._buf):
            if self._in_str:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return -1


def _could_be_head(buf: str) -> bool:
    probe = '{"name": "'
    s = buf.lstrip()
    return probe.startswith(s) if len(s) < len(probe) else s.startswith(probe)


def _on_unused(*_: object) -> None:   # ToolParser's lexer hook; this parser scans itself
    return None


JsonCallsParser._on = _on_unused     # type: ignore[method-assign]
