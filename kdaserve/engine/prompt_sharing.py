"""Prompt logprobs scored once per prompt: a request's n sequences, and requests that ask for
the logprobs of a prompt another live request is already scoring (the same token ids, top-k,
cache salt and extra keys, no images), take the leader's instead of scoring it again.

Why across requests: one completions call with a list of prompts is a request per prompt,
and a client may repeat a prompt in it (issue 35's probe sends one 1,000-token prompt 16
times) or in concurrent calls; each would otherwise run its whole prompt through the logits
(a request that scores its prompt skips prefix-cache hits, prompt_logprobs.py). A follower waits
until its leader has computed the prompt (the
scheduler's `leader_done`), then starts from the leader's cached blocks like any prefix hit
and samples its own tokens; its first delta carries the leader's entries. The entries are
the same either way: the leader's rows would be computed identically for the follower (rows
do not depend on the batch).

A leader that ends before it has scored (an abort) leaves its followers to score the prompt
themselves: `forget` returns them, and the engine gives them their own top-k back before
they start (they wait for the leader, so none has started). Plain Python, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ShareKey = tuple


@dataclass
class _Scores:
    key: ShareKey | None
    entries: list | None = None            # set once the leader has emitted them
    followers: set[str] = field(default_factory=set)
    leader_live: bool = True


class PromptScores:
    def __init__(self) -> None:
        self._by_key: dict[ShareKey, str] = {}       # live leaders open to new followers
        self._scores: dict[str, _Scores] = {}        # by leader id
        self._leader_of: dict[str, str] = {}         # follower id -> leader id

    def __len__(self) -> int:
        return len(self._scores)

    def leader(self, key: ShareKey) -> str | None:
        """A live request scoring this prompt that has not emitted its entries yet."""
        lead = self._by_key.get(key)
        if lead is None or self._scores[lead].entries is not None:
            return None
        return lead

    def lead(self, leader: str, key: ShareKey | None) -> None:
        """`leader` scores its prompt; with a key, later requests of that prompt may follow."""
        self._scores[leader] = _Scores(key)
        if key is not None:
            self._by_key[key] = leader

    def follow(self, follower: str, leader: str) -> None:
        self._scores[leader].followers.add(follower)
        self._leader_of[follower] = leader

    def scored(self, leader: str, entries: list) -> None:
        """The leader's entries, kept for its followers (dropped at once if it has none)."""
        s = self._scores.get(leader)
        if s is None:
            return
        s.entries = entries
        self._close_key(leader, s)
        self._drop_if_done(leader, s)

    def take(self, follower: str) -> list | None:
        """The entries for a follower's first delta (it follows no more)."""
        leader = self._leader_of.pop(follower, None)
        s = self._scores.get(leader) if leader is not None else None
        if s is None:
            return None
        s.followers.discard(follower)
        entries = s.entries
        self._drop_if_done(leader, s)
        return entries

    def forget(self, rid: str) -> list[str]:
        """`rid` ended. Returns the followers left without entries (their leader ended before
        scoring): they must score the prompt themselves."""
        leader = self._leader_of.pop(rid, None)
        if leader is not None:                        # a follower
            s = self._scores[leader]
            s.followers.discard(rid)
            self._drop_if_done(leader, s)
            return []
        s = self._scores.get(rid)
        if s is None:
            return []
        s.leader_live = False
        self._close_key(rid, s)
        orphans: list[str] = []
        if s.entries is None:
            orphans = sorted(s.followers)
            for f in orphans:
                del self._leader_of[f]
            s.followers.clear()
        self._drop_if_done(rid, s)
        return orphans

    def _close_key(self, leader: str, s: _Scores) -> None:
        if s.key is not None and self._by_key.get(s.key) == leader:
            del self._by_key[s.key]

    def _drop_if_done(self, leader: str, s: _Scores) -> None:
        if not s.followers and (not s.leader_live or s.entries is not None):
            self._scores.pop(leader, None)
            self._close_key(leader, s)
