"""Stop strings found in streamed text at a cost per character that does not depend on how
many stop strings there are (Aho-Corasick over the stop strings, fed incrementally).

`feed(text)` reports the first stop string that *ends* in the stream (the longest of those
ending at the same character), and `pending` is the length of the longest suffix of the stream
that could still grow into a stop string: the text a streaming server must hold back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._word: list[str | None] = [None]     # stop string ending here (longest), if any
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._word.append(None)
                node = nxt
            self._word[node] = stop
        self._fail = [0] * len(self._goto)
        queue = deque(self._goto[0].values())
        while queue:                                # breadth first: fail links point up
            node = queue.popleft()
            if self._word[node] is None:            # the longest stop ending here
                self._word[node] = self._word[self._fail[node]]
            for ch, child in self._goto[node].items():
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                self._fail[child] = self._goto[f].get(ch, 0)
                queue.append(child)
        self._state = 0

    @property
    def pending(self) -> int:
        return self._depth[self._state]

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over text; (index in text where the match ends + 1, stop) of the first
        match, or None. After a match the matcher should not be fed again."""
        goto, fail, word = self._goto, self._fail, self._word
        state = self._state
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if word[state] is not None:
                self._state = state
                return i + 1, word[state]
        self._state = state
        return None
