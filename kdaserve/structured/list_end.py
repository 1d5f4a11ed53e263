"""Ending a grammar's list of items while max_tokens can still close it.

A grammar like the forced tool calls' `[call, call, ...]` lets the model add items for as long
as it likes; a small model adds them until max_tokens cuts one in half (issue 31: 22 calls,
the last one unusable, and `finish_reason: "length"`, on which the openai SDK's helpers
raise). The grammar cannot see the budget; the engine can. A spec that names its
`list_separator` (the text from the end of one item to where the next one's content starts,
e.g. `, {"name": "f", "arguments": ` for the calls) gets this rule on top of its mask: when
the tokens left are fewer than another item may take (twice the longest so far, the current
one included) plus the list's end, the tokens that would cross into the separator are masked
out, so the model can only close the list. An item that is cut anyway (the first one, or one
longer than all before it) is dropped by the parser (tool_parsers/json_calls.py).

Which tokens cross is asked of the matcher, not guessed from text. The candidates are the
tokens whose text ends in a prefix of the separator, at most `PROBE_SPAN` characters of it
(`}, {"` is one token in many vocabularies): a few dozen in a large vocabulary, found once.
A candidate crosses if, after it, the rest of the separator is accepted; the rest is long
enough (it names a function) that no item's own content (a comma inside the arguments)
matches it.
"""

from __future__ import annotations

import llguidance as llg
import torch

PROBE_SPAN = 12
CLOSE_TOKENS = 2             # the list's end and EOS
ROOM_FACTOR = 2              # an item may be longer than those before it (a new function, a
#                              longer string): room for twice the longest, or no new item


class ListEnd:
    def __init__(self, lltok: llg.LLTokenizer, separator: str, candidates: dict[int, int]
                 ) -> None:
        """candidates: `crossing_candidates(...)` of this separator."""
        self.candidates = candidates
        self.probes = {k: lltok.tokenize_str(separator[k:]) for k in set(candidates.values())}
        self._item_start = 0         # output tokens before the current item
        self.longest = 0             # tokens of the longest finished item

    def crosses(self, matcher: llg.LLMatcher, token: int) -> bool:
        """Would `token` (allowed now) end the current item and start the separator?"""
        k = self.candidates.get(token)
        if k is None:
            return False
        probe = self.probes[k]
        return matcher.validate_tokens([token, *probe]) == len(probe) + 1

    def on_token(self, matcher: llg.LLMatcher, token: int, num_before: int) -> None:
        """Called before the matcher consumes `token`, the output's token `num_before`."""
        if self.crosses(matcher, token):
            self.longest = max(self.longest, num_before - self._item_start)
            self._item_start = num_before

    def restrict(self, matcher: llg.LLMatcher, row: torch.Tensor, num_output: int,
                 max_tokens: int) -> None:
        """Clear, in this step's mask `row` ([W] int32 words), the tokens that would start
        another item when there is no room left for one."""
        need = ROOM_FACTOR * max(self.longest, num_output - self._item_start) + CLOSE_TOKENS
        if max_tokens - num_output > need:
            return
        as_bytes = row.view(torch.uint8).numpy()   # id i is bit i % 8 of byte i // 8
        for t in self.candidates:
            if as_bytes[t // 8] >> (t % 8) & 1 and self.crosses(matcher, t):
                as_bytes[t // 8] &= ~(1 << (t % 8)) & 0xFF


def crossing_candidates(lltok: llg.LLTokenizer, vocab_size: int, separator: str
                        ) -> dict[int, int]:
    """token id -> k, for the tokens whose text ends in separator[:k] (1 <= k <= PROBE_SPAN,
    leaving at least half of the separator to probe with)."""
    span = min(PROBE_SPAN, len(separator) // 2)
    heads = {separator[:k].encode(): k for k in range(1, span + 1)}
    first = separator[:1].encode()
    found = {}
    for t in range(min(vocab_size, lltok.vocab_size)):
        text = lltok.decode_bytes([t])
        at = text.find(first)
        while at != -1:
            k = heads.get(text[at:])
            if k is not None:
                found[t] = k
                break
            at = text.find(first, at + 1)
    return found
