"""One request's grammar state: the llguidance matcher and how many output tokens it has seen.

The count is what keeps the matcher honest across everything that changes a request's tokens
outside the sampler (a stop string cutting an accepted run, preemption, retries): before each
mask the matcher is synced to the request's output ids, consuming what it has not seen or
rolling back what the request no longer has.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import llguidance as llg

from kdaserve.structured.list_end import ListEnd

logger = logging.getLogger("kdaserve")


class RequestGrammar:
    def __init__(self, matcher: llg.LLMatcher, eos_ids: Sequence[int],
                 list_end: ListEnd | None = None) -> None:
        self.matcher = matcher
        self.list_end = list_end
        self.eos_ids = list(eos_ids)
        self.num_tokens = 0          # output tokens consumed
        self.done = False            # the grammar finished (EOS taken) or failed: EOS only
        self.error: str | None = None  # why the matcher failed (the request ends with it)

    def sync(self, output_ids: Sequence[int]) -> None:
        self.sync_to(len(output_ids), output_ids[self.num_tokens:])

    def sync_to(self, num_output: int, unseen: Sequence[int]) -> None:
        """Sync to a request of num_output output tokens whose ids past the consumed ones are
        `unseen` (a copy taken on the engine thread, so this may run on another)."""
        if self.done:
            return
        if num_output < self.num_tokens:
            back = self.num_tokens - num_output
            if not self.matcher.rollback(back):
                self._fail("rollback failed")
                return
            self.num_tokens = num_output
        self.accept(unseen)

    def accept(self, tokens: Sequence[int]) -> None:
        """Consume sampled tokens (the sampler only picks allowed ones, so a refusal means
        the grammar ended or the matcher failed: the rest of the output is EOS only)."""
        for t in tokens:
            if self.done:
                return
            self.num_tokens += 1
            if self.matcher.is_stopped():
                self.done = True
                return
            if self.list_end is not None:
                self.list_end.on_token(self.matcher, t, self.num_tokens - 1)
            if not self.matcher.consume_token(t):
                self._fail(self.matcher.get_error() or f"token {t} refused")
                return
            if self.matcher.is_stopped() and t in self.eos_ids:
                self.done = True

    def rollback(self, n: int) -> None:
        """Forget the last n consumed tokens (drafts a verification rejected)."""
        if n and not self.done and self.matcher.rollback(n):
            self.num_tokens -= n

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar accepts from the current state."""
        if self.done or not drafts:
            return 0
        return int(self.matcher.validate_tokens(list(drafts)))

    def _fail(self, why: str) -> None:
        logger.warning("grammar matcher failed; its request ends with an error: %s", why)
        self.done = True
        self.error = why
