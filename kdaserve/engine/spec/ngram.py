"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from ngram_max down to ngram_min). No model, no state."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_tokens: int, ngram_min: int = 2, ngram_max: int = 4,
                 window: int = 8192) -> None:
        self.k = num_tokens
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.window = window

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k drafts to follow `token_ids` (empty when no earlier match exists)."""
        ids = np.asarray(token_ids[-self.window:], dtype=np.int64)
        n_tok = len(ids)
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            tail = ids[n_tok - n:]
            # windows starting at i = 0 .. n_tok-n-1 (the tail itself excluded)
            win = np.lib.stride_tricks.sliding_window_view(ids[:n_tok - 1], n)
            hits = np.flatnonzero((win == tail).all(1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start:start + self.k].tolist()
        return []
