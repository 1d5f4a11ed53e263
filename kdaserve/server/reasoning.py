"""Reasoning parsers by name (`--reasoning-parser`): thinking text -> `reasoning_content`.

Text between a format's start and end markers is reasoning; the rest is content. A chat
template that opens the thinking block itself (the prompt ends with the start marker) makes
the output start in reasoning. Markers split across stream chunks are held back until whole.
Structural markers a format wraps its answer in (K3's response/message elements) are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.server.tool_parsers.base import MarkerLexer


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    drop: tuple[str, ...] = ()


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    # K3 writes XTML elements (mlx-lm's tokenizer_utils names these markers)
    "kimi_k3": ReasoningFormat("kimi_k3", "<|open|>think<|sep|>", "<|close|>think<|sep|>",
                               drop=("<|open|>response<|sep|>", "<|close|>response<|sep|>",
                                     "<|close|>message<|sep|>")),
    "kimi_k2": ReasoningFormat("kimi_k2", "<think>", "</think>"),
}

# Chat-template switches that turn thinking off, as the Kimi templates (and others) name them.
THINKING_KWARGS = ("thinking", "enable_thinking")


class ReasoningParser:
    def __init__(self, fmt: ReasoningFormat, prompt_text: str = "") -> None:
        self.fmt = fmt
        self.in_reasoning = prompt_text.rstrip().endswith(fmt.start)
        self._lexer = MarkerLexer((fmt.start, fmt.end, *fmt.drop))

    def feed(self, text: str) -> list[tuple[bool, str]]:
        """(is_reasoning, text) pieces."""
        return self._route(self._lexer.feed(text))

    def finish(self) -> list[tuple[bool, str]]:
        return self._route(self._lexer.flush())

    def _route(self, pieces: list[tuple[bool, str]]) -> list[tuple[bool, str]]:
        out = []
        for is_marker, piece in pieces:
            if not is_marker:
                out.append((self.in_reasoning, piece))
            elif piece == self.fmt.start:
                self.in_reasoning = True
            elif piece == self.fmt.end:
                self.in_reasoning = False
        return out

    @classmethod
    def split(cls, fmt: ReasoningFormat, text: str, prompt_text: str = "") -> tuple[str, str]:
        """(reasoning, content) of a whole message."""
        p = cls(fmt, prompt_text)
        pieces = p.feed(text) + p.finish()
        return ("".join(t for r, t in pieces if r), "".join(t for r, t in pieces if not r))
