"""Kimi K3's tool calls: XTML elements made of the `<|open|>`, `<|close|>`, `<|sep|>` tokens.

    <|open|>tools<|sep|>
      <|open|>call tool="get_weather" index="1"<|sep|>
        <|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>
        <|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>
      <|close|>call<|sep|>
    <|close|>tools<|sep|>

or one `<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>` in place of the arguments
(format as in mlx-lm's kimi_k3 parser). Typed arguments become a JSON object in their order:
"string" values (the default type) verbatim, others parsed as JSON (kept as a string if they
do not parse). Attribute values unescape &quot; and &amp;.
"""

from __future__ import annotations

import json
import re

from kdaserve.server.tool_parsers.base import ToolParser, new_call_id

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
_ATTR = re.compile(r'(\w+)="([^"]*)"')
_NAME = re.compile(r"\s*([A-Za-z_][\w.-]*)")


def _attrs(text: str) -> dict[str, str]:
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(text)}


def _dump(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


class KimiK3ToolParser(ToolParser):
    name = "kimi_k3"
    markers = (OPEN, CLOSE, SEP)

    def __init__(self, eager: bool = True) -> None:
        super().__init__(eager)
        self._tag: str | None = None      # OPEN or CLOSE whose head is being read
        self._head = ""
        self._in_tools = False
        self._call: _Call | None = None
        self._bad_call_raw: str | None = None   # a call whose header is malformed: raw text

    # ---- lexing: elements from markers --------------------------------------------------------
    def _on(self, is_marker: bool, piece: str) -> None:
        if self._tag is not None:
            if is_marker and piece == SEP:
                tag, head = self._tag, self._head
                self._tag, self._head = None, ""
                self._element(tag, head)
                return
            if not is_marker:
                self._head += piece
                return
            raw, self._tag, self._head = self._tag + self._head, None, ""
            self._text(raw)               # not a tag after all
        if is_marker and piece in (OPEN, CLOSE):
            self._tag = piece
        else:
            self._text(piece)

    def _element(self, tag: str, head: str) -> None:
        m = _NAME.match(head)
        name = m.group(1) if m else ""
        raw = f"{tag}{head}{SEP}"
        if self._bad_call_raw is not None:
            self._bad_call_raw += raw
            if tag == CLOSE and name == "call":
                self.content(self._bad_call_raw)
                self._bad_call_raw = None
            return
        if self._call is not None:
            self._call.raw += raw
            self._call_element(tag, name, head[m.end():] if m else head)
            return
        if tag == OPEN and name == "tools" and not self._in_tools:
            self._in_tools = True
        elif tag == CLOSE and name == "tools" and self._in_tools:
            self._in_tools = False
        elif tag == OPEN and name == "call" and self._in_tools:
            attrs = _attrs(head[m.end():] if m else head)
            if attrs.get("tool"):
                self._call = _Call(self, attrs["tool"], raw)
            else:
                self._bad_call_raw = raw
        else:
            self.content(raw)

    def _call_element(self, tag: str, name: str, rest: str) -> None:
        call = self._call
        assert call is not None
        if tag == OPEN and name == "argument" and call.mode is None:
            call.begin_argument(_attrs(rest))
        elif tag == CLOSE and name == "argument" and call.mode == "argument":
            call.end_argument()
        elif tag == OPEN and name == "json" and call.mode is None and not call.keys:
            call.mode = "json"
        elif tag == CLOSE and name == "json" and call.mode == "json":
            call.mode = "json_done"
        elif tag == CLOSE and name == "call":
            self._call = None
            call.close()
        else:
            call.malformed = True

    def _text(self, text: str) -> None:
        if self._bad_call_raw is not None:
            self._bad_call_raw += text
        elif self._call is not None:
            self._call.raw += text
            self._call.text(text)
        elif self._in_tools and not text.strip():
            pass                          # layout between calls
        else:
            self.content(text)

    def _end(self) -> None:
        if self._tag is not None:
            self._text(self._tag + self._head)
            self._tag = None
        if self._bad_call_raw is not None:
            self.content(self._bad_call_raw)
            self._bad_call_raw = None
        if self._call is not None:
            call, self._call = self._call, None
            if not self.eager:
                self.content(call.raw)    # unfinished: back to text
            elif call.keys:
                self.args(call.index, "}")


class _Call:
    """One call's arguments, streamed (eager) or checked and released at its close."""

    def __init__(self, parser: KimiK3ToolParser, name: str, raw: str) -> None:
        self.p = parser
        self.name = name
        self.raw = raw
        self.mode: str | None = None      # None, "argument", "json", "json_done"
        self.keys: list[str] = []
        self.values: list[object] = []
        self.arg_type = "string"
        self.buf = ""
        self.json_text = ""
        self.malformed = False
        self.index = parser.call_start(new_call_id(), name) if parser.eager else -1

    def emit(self, fragment: str) -> None:
        if self.p.eager:
            self.p.args(self.index, fragment)

    def begin_argument(self, attrs: dict[str, str]) -> None:
        key = attrs.get("key")
        if key is None:
            self.malformed = True
            key = ""
        self.mode, self.arg_type, self.buf = "argument", attrs.get("type", "string"), ""
        self.emit(("{" if not self.keys else ", ") + _dump(key) + ": ")
        self.keys.append(key)
        if self.arg_type == "string":
            self.emit('"')

    def text(self, text: str) -> None:
        if self.mode == "argument":
            self.buf += text
            if self.arg_type == "string":
                self.emit(_dump(text)[1:-1])
        elif self.mode == "json":
            self.json_text += text
            self.emit(text)
        elif text.strip():
            self.malformed = True

    def end_argument(self) -> None:
        if self.arg_type == "string":
            value: object = self.buf
            self.emit('"')
        else:
            try:
                value = json.loads(self.buf)
            except ValueError:
                value = self.buf
            self.emit(_dump(value))
        self.values.append(value)
        self.mode = None

    def close(self) -> None:
        p = self.p
        if self.mode == "json_done":
            try:
                obj = json.loads(self.json_text)
                ok = isinstance(obj, dict)
            except ValueError:
                ok = False
            args = self.json_text.strip()
        else:
            ok = self.mode is None
            args = "{" + ", ".join(f"{_dump(k)}: {_dump(v)}"
                                   for k, v in zip(self.keys, self.values)) + "}"
            if p.eager:
                self.emit("}" if self.keys else "{}")
        if p.eager:
            return                        # already streamed: a stream cannot take it back
        if ok and not self.malformed:
            p.args(p.call_start(new_call_id(), self.name), args)
        else:
            p.content(self.raw)
