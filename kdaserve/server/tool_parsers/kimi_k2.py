"""Kimi K2's tool calls (format as in vLLM's and mlx-lm's kimi_k2 parsers):

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Tokyo"}
    <|tool_call_end|>
    <|tool_calls_section_end|>

The call id is the function id the model wrote (`functions.NAME:INDEX`), which is what K2's chat
template expects back in `tool_call_id`; the name is the part between the first "." and ":".
"""

from __future__ import annotations

import json
import re

from kdaserve.server.tool_parsers.base import ToolParser

BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_FUNCTION_ID = re.compile(r"^\s*(?:[\w-]+\.)?([A-Za-z_][\w.-]*):(\d+)\s*$")


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    markers = (BEGIN, END, CALL, ARGS, CALL_END)

    def __init__(self, eager: bool = True) -> None:
        super().__init__(eager)
        self._in_section = False
        self._state: str | None = None     # None, "id", "args"
        self._id = ""
        self._args = ""
        self._raw = ""
        self._index = -1

    def _on(self, is_marker: bool, piece: str) -> None:
        if self._state is not None:
            self._raw += piece
            if self._state == "id":
                if not is_marker:
                    self._id += piece
                elif piece == ARGS and _FUNCTION_ID.match(self._id):
                    self._state = "args"
                    if self.eager:
                        self._index = self.call_start(self._id.strip(), self._name())
                else:
                    self._bad("id")
            elif not is_marker:
                self._args += piece
                if self.eager:
                    self.args(self._index, piece)
            elif piece == CALL_END:
                self._close()
            else:
                self._bad("args")
            return
        if is_marker and piece == BEGIN:
            self._in_section = True
        elif is_marker and piece == END:
            self._in_section = False
        elif is_marker and piece == CALL and self._in_section:
            self._state, self._id, self._args, self._raw = "id", "", "", piece
        elif self._in_section and not is_marker and not piece.strip():
            pass
        else:
            self.content(piece)

    def _name(self) -> str:
        m = _FUNCTION_ID.match(self._id)
        return m.group(1) if m else ""

    def _close(self) -> None:
        self._state = None
        if self.eager:
            return
        try:
            ok = isinstance(json.loads(self._args), dict)
        except ValueError:
            ok = False
        if ok:
            self.args(self.call_start(self._id.strip(), self._name()), self._args.strip())
        else:
            self.content(self._raw)

    def _bad(self, was: str) -> None:
        """A marker out of place inside a call: the call is text (in a stream, a call whose
        header was already sent stays sent)."""
        self._state = None
        if not self.eager or was == "id":
            self.content(self._raw)

    def _end(self) -> None:
        if self._state is not None and not self.eager:
            self.content(self._raw)
        elif self._state == "id":
            self.content(self._raw)
        self._state = None
