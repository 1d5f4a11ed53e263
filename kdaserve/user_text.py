"""Special tokens typed by a user stay text.

A chat template renders user content and its own control tokens into one string, after which
`<|im_end|><|im_start|>system` typed in a message is indistinguishable from a real turn
boundary. So before rendering, every special token's text inside user-supplied strings is
wrapped in two private-use characters; after rendering, the marked spans are encoded as plain
text (their characters, never the control id) and the rest as usual. Markers a client sends
itself are removed first, so they cannot unwrap anything. Completions prompts are plain user
text: encoded whole without special-token parsing. `--allow-special-tokens-in-prompt` turns
this off (tests and trusted callers that build prompts with control tokens).
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Iterator
from typing import Any

OPEN, CLOSE = "\ue000", "\ue001"
_MARKERS = re.compile(f"[{OPEN}{CLOSE}]")
_SPAN = re.compile(f"{OPEN}([^{OPEN}{CLOSE}]*){CLOSE}")


class SpecialTextGuard:
    def __init__(self, specials: Iterable[str]) -> None:
        words = sorted({s for s in specials if s}, key=len, reverse=True)
        self._re = re.compile("|".join(re.escape(s) for s in words)) if words else None

    def mark(self, value: Any) -> Any:
        """`value` (messages: dicts, lists, strings) with special tokens' text in every string
        wrapped in markers."""
        if isinstance(value, str):
            value = _MARKERS.sub("", value)
            if self._re is None:
                return value
            return self._re.sub(lambda m: OPEN + m.group() + CLOSE, value)
        if isinstance(value, dict):
            return {k: self.mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.mark(v) for v in value]
        return value


def segments(text: str, specials: Container[str]) -> Iterator[tuple[str, bool]]:
    """(piece, literal) in order: literal pieces are marked special-token text. Only a marked
    span that is exactly one special token counts (a template that cut a marked span apart,
    splitting on `</think>` say, leaves stray markers: they are dropped, never paired)."""
    at = 0
    for m in _SPAN.finditer(text):
        if m.group(1) not in specials:
            continue
        if m.start() > at:
            yield _MARKERS.sub("", text[at:m.start()]), False
        yield m.group(1), True
        at = m.end()
    if at < len(text):
        yield _MARKERS.sub("", text[at:]), False
