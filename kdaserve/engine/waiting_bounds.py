"""The server's bound on work waiting for its first token (AsyncEngine): the sequences (n per
prompt) accepted and still without a token, and their prompt tokens. A request beyond either
limit is refused with QueueFullError at once (the server answers 429 with Retry-After) instead
of queueing without limit; one request alone is always accepted, whatever its size."""

from __future__ import annotations

from kdaserve.engine.engine_errors import QueueFullError

DEFAULT_MAX_WAITING = 1024     # sequences accepted but without a first token yet
DEFAULT_MAX_QUEUED_TOKENS = 1 << 20    # their prompt tokens


class WaitingBounds:
    def __init__(self, max_waiting: int = DEFAULT_MAX_WAITING,
                 max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self.max_queued_tokens = max_queued_tokens
        self._entries: dict[str, tuple[int, int]] = {}   # request -> (sequences, tokens)
        self._tokens = 0

    @property
    def num_waiting(self) -> int:
        return sum(n for n, _ in self._entries.values())

    def admit(self, request_id: str, sequences: int, prompt_tokens: int) -> None:
        """Count a request in, or raise QueueFullError when it would pass a limit."""
        queued, tokens = self.num_waiting, prompt_tokens * sequences
        if queued and (queued + sequences > self.max_waiting
                       or self._tokens + tokens > self.max_queued_tokens):
            raise QueueFullError(
                f"{queued} sequences ({self._tokens} prompt tokens) are waiting for their "
                f"first token (limits: {self.max_waiting} sequences, "
                f"{self.max_queued_tokens} tokens); retry later")
        self._entries[request_id] = (sequences, tokens)
        self._tokens += tokens

    def release(self, request_id: str) -> None:
        """The request got its first token, or ended."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._tokens -= entry[1]
