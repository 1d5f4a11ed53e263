"""Requests that carry a grammar wait here, off the engine loop, until it is compiled.

A new spec's compile and its first-mask trial (structured/compiler.py: under a budget, else a
400 naming the field) may take up to about a second. The engine process's loop hands such a
request to this one compile thread and goes on stepping the others (and sending heartbeats);
the request reaches the scheduler only once its grammar is in the cache, where
`add_request`'s check is then a lookup, or is refused with the compiler's reason. llguidance
releases the GIL while it compiles and computes masks, so the thread takes no time from the
loop's Python (measured: the loop's longest pause stays at a few milliseconds).

One thread: grammars compile one after another, so a costly spec delays the next new spec by
at most the budget, never a request without a grammar or one whose grammar is cached.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from kdaserve.background_pool import background_pool
from kdaserve.structured.spec import GuidedDecoding

T = TypeVar("T")


@dataclass
class Compiled(Generic[T]):
    """A request whose grammar is settled: `error` is None (admit `item`) or why not."""

    request_id: str
    item: T
    error: BaseException | None


class GrammarAdmission(Generic[T]):
    """`validate` compiles (or finds cached) a spec and raises GuidedDecodingError for a bad
    one; `item` is whatever the caller admits once it is done (the engine's add command)."""

    def __init__(self, validate: Callable[[GuidedDecoding], None]) -> None:
        self._validate = validate
        self._pool = background_pool(1, "kdaserve-compile")
        self._pending: dict[str, tuple[Future[None], T]] = {}     # in arrival order

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, request_id: str, guided: GuidedDecoding, item: T) -> None:
        self._pending[request_id] = (self._pool.submit(self._validate, guided), item)

    def discard(self, request_id: str) -> bool:
        """Forget an aborted request (its compile still finishes and is cached)."""
        return self._pending.pop(request_id, None) is not None

    def done(self) -> list[Compiled[T]]:
        """The requests whose compile finished since the last call, in arrival order."""
        out = []
        for rid, (fut, item) in list(self._pending.items()):
            if fut.done():
                del self._pending[rid]
                out.append(Compiled(rid, item, fut.exception()))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
