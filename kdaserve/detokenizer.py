"""Incremental detokenization with stop-string handling for streaming output.

Text is produced by decoding a small window of token ids: ``ids[prefix:read]`` is context that
was already emitted, ``ids[read:]`` is pending. Emitting ``decode(ids[prefix:])`` minus
``decode(ids[prefix:read])`` keeps the leading-space behaviour of SentencePiece/ByteLevel
decoders right. While the decoded window ends in U+FFFD, a multi-byte character may still be
incomplete, so the pending tokens are held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kdaserve.stop_matcher import StopMatcher
from kdaserve.tokenizer import Tokenizer

__all__ = ["DetokenizerDelta", "IncrementalDetokenizer"]

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context in front of the first generated token.
PROMPT_CONTEXT_TOKENS = 5
# After this many pending tokens whose text still ends in U+FFFD (invalid bytes, or a literal
# U+FFFD token), all but the newest are emitted if that split is clean, bounding the window.
MAX_PENDING_TOKENS = 6


@dataclass
class DetokenizerDelta:
    text: str
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turn generated token ids into text deltas, stopping at the first stop string.

    A stop string matches at the earliest position where it *ends*, as if the text were
    scanned one character at a time. After a match, further pushes yield empty deltas. Text
    held back for an unfinished character is searched once the character completes, so such
    a stop string may be reported one push late (with the same truncated output).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        defer: bool = False,
    ) -> None:
        """defer: nobody reads the text before the end (no stream, no stop strings): push only
        collects the ids and flush decodes them at once, the same text in one decode instead
        of two a token."""
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = StopMatcher(stop) if stop else None
        self._include_stop = include_stop_str_in_output
        prompt = [i for i in prompt_token_ids if self._keeps(i)]
        self._ids = prompt[max(len(prompt) - PROMPT_CONTEXT_TOKENS, 0) :]
        self._prefix = 0
        self._read = len(self._ids)
        self._defer = defer and not stop
        self._held = ""  # decoded text that might be the start of a stop string
        self.output_text = ""
        self.stop_string: str | None = None

    @property
    def finished(self) -> bool:
        return self.stop_string is not None

    def push(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        if self.finished:
            return DetokenizerDelta("")
        if self._defer:
            self._ids.extend(t for t in token_ids if self._keeps(t))
            return DetokenizerDelta("")
        text = []
        for token_id in token_ids:
            if self._keeps(token_id):
                self._ids.append(token_id)
                text.append(self._decode_step())
        return self._emit("".join(text), final=False)

    def flush(self) -> str:
        """Emit everything still held back (call once generation has ended)."""
        if self.finished:
            return ""
        prefix_text, new_text = self._decode_window()
        tail = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._advance(len(self._ids))
        return self._emit(tail, final=True).text

    def _keeps(self, token_id: int) -> bool:
        # Skipped special tokens decode to nothing; keeping them out of the window keeps it small.
        return not (self._skip_special and token_id in self._tokenizer.special_token_ids)

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        ids, skip = self._ids, self._skip_special
        prefix_text = decode(ids[self._prefix : self._read], skip_special_tokens=skip)
        return prefix_text, decode(ids[self._prefix :], skip_special_tokens=skip)

    def _decode_step(self) -> str:
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text):
            return ""
        if not new_text.endswith(REPLACEMENT_CHAR):
            self._advance(len(self._ids))
            return new_text[len(prefix_text) :]
        if len(self._ids) - self._read >= MAX_PENDING_TOKENS:
            return self._split_pending(prefix_text, new_text)
        return ""

    def _split_pending(self, prefix_text: str, new_text: str) -> str:
        """Emit the pending tokens before the newest one, unless that cuts a UTF-8 sequence.

        A cut sequence decodes to more replacement characters in two halves than joined, so
        equal text proves the cut is clean; the newest token's byte(s) after the cut are
        known, so later tokens cannot change that.
        """
        decode, skip = self._tokenizer.decode, self._skip_special
        split = len(self._ids) - 1
        head = decode(self._ids[self._prefix : split], skip_special_tokens=skip)
        tail = decode(self._ids[split:], skip_special_tokens=skip)
        if not tail or head + tail != new_text or len(head) <= len(prefix_text):
            return ""
        self._advance(split)
        return head[len(prefix_text) :]

    def _advance(self, read: int) -> None:
        """Make ids[read_old:read] the new context and drop ids before it."""
        del self._ids[: self._read]
        self._prefix, self._read = 0, read - self._read

    def _emit(self, text: str, final: bool) -> DetokenizerDelta:
        """Held text was already fed to the matcher: only the new text is scanned, so a token
        costs the same whatever the number of stop strings."""
        buffer = self._held + text
        match = self._stops.feed(text) if self._stops is not None else None
        if match is not None:
            end, stop = match
            end += len(self._held)
            out = buffer[:end] if self._include_stop else buffer[: end - len(stop)]
            self._held, self.stop_string = "", stop
        else:
            keep = 0 if final or self._stops is None else self._stops.pending
            out, self._held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        self.output_text += out
        return DetokenizerDelta(out, self.stop_string)
