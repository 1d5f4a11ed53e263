"""Structured outputs in the engine process: compile specs (cached), keep each request's
matcher, compute a step's masks while the model runs, advance matchers with sampled tokens.

Masks for a step are known before its forward pass (the tokens sampled so far and a verify
row's drafts come with the schedule), so `prepare` computes them on a worker thread
(llguidance releases the GIL) while torch runs the model, and the sampler waits only for what
is left. The matchers consume the last step's tokens in that same job, before the masks: off
the critical path too. Only speculation needs them consumed at once (`advance`), to check the
next drafts against the grammar. A verify row gets one mask per position, computed along its
drafts and rolled back (llguidance's draft-aware batch call), so a draft the grammar refuses
is never accepted and positions after it stay unconstrained (they are never used).

llguidance (and everything that compiles grammars) is imported on the first request with a
grammar, not here: every runner and engine core builds a StructuredOutputs, and a process that
never sees a grammar never loads the compiler. The vocabulary walk waits for that request too.

Legend: W = ceil(V / 32) mask words, P positions of a row (drafts + 1).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kdaserve.outputs import SampledToken, ScheduledSequence
from kdaserve.request import Request
from kdaserve.structured import bitmask
from kdaserve.structured.spec import GuidedDecoding, GuidedDecodingError
from kdaserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance as llg

    from kdaserve.structured.compiler import GrammarCache
    from kdaserve.structured.list_end import ListEnd
    from kdaserve.structured.matcher import RequestGrammar

logger = logging.getLogger("kdaserve")


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos = sorted(tokenizer.eos_token_ids) if tokenizer is not None else []
        self._cache: GrammarCache | None = None
        self._cache_lock = threading.Lock()
        self._grammars: dict[str, RequestGrammar] = {}
        self._pending: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdaserve-grammar")
        self._threads = threads
        self._executor: llg.LLExecutor | None = None    # built with the first masks
        self._failures: dict[str, str] = {}
        self._crossing: dict[str, dict[int, int]] = {}   # list_end.py's candidates

    def _grammar_cache(self) -> GrammarCache:
        with self._cache_lock:
            if self._cache is None:
                if self._tokenizer is None:
                    raise GuidedDecodingError("structured outputs need a tokenizer; this model "
                                              "directory has none")
                from kdaserve.structured.compiler import GrammarCache
                from kdaserve.structured.tokenizer import build_lltokenizer

                try:
                    lltok = build_lltokenizer(self._tokenizer, self.vocab_size)
                except Exception as exc:     # an unusual vocabulary: a 400, not an engine fault
                    raise GuidedDecodingError(f"structured outputs are not available for this "
                                              f"tokenizer: {type(exc).__name__}: {exc}") from None
                self._cache = GrammarCache(lltok)
            return self._cache

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, g: GuidedDecoding) -> None:
        """Compile (or find cached) the request's grammar; GuidedDecodingError says why not
        (prefixed with the request field that carried it)."""
        try:
            self._grammar_cache().get(g)
        except GuidedDecodingError as exc:
            raise GuidedDecodingError(f"{g.field}: {exc}" if g.field else str(exc)) from None

    def _state(self, req: Request) -> RequestGrammar | None:
        g = req.sampling_params.guided
        if g is None:
            return None
        st = self._grammars.get(req.request_id)
        if st is None:
            from kdaserve.structured.matcher import RequestGrammar

            st = self._grammars[req.request_id] = RequestGrammar(
                self._grammar_cache().matcher(g), self._eos, self._list_end(g))
        return st

    def _list_end(self, g: GuidedDecoding) -> ListEnd | None:
        if not g.list_separator:
            return None
        from kdaserve.structured.list_end import PROBE_SPAN, ListEnd, crossing_candidates

        lltok = self._grammar_cache().tokenizer
        head = g.list_separator[:PROBE_SPAN]
        if head not in self._crossing:      # a walk of the vocabulary, once per separator
            self._crossing[head] = crossing_candidates(lltok, self.vocab_size, g.list_separator)
        return ListEnd(lltok, g.list_separator, self._crossing[head])

    def forget(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)
        self._failures.pop(request_id, None)

    # ---- one step ---------------------------------------------------------------------------
    def prepare(self, seqs: Sequence[ScheduledSequence], requests: Mapping[str, Request],
                ) -> Future[dict[str, torch.Tensor]] | None:
        """Start computing the masks of this step's sampling rows: {request id: [P, W]}."""
        if self._pending is not None:      # a failed step may have left one running
            self._pending.exception()
            self._pending = None
        rows: list[_Row] = []
        for s in seqs:
            req = requests.get(s.request_id)
            if req is None or not (s.sample or s.num_draft_tokens):
                continue
            st = self._state(req)
            if st is None:
                continue
            out = req.output_token_ids   # no job is running: num_tokens is settled
            drafts = list(s.token_ids[1:]) if s.num_draft_tokens else []
            # a list end's restriction depends on max_tokens too: such rows are not shared
            share = ((req.sampling_params.guided.key, len(out))
                     if not drafts and st.list_end is None else None)
            rows.append(_Row(s.request_id, st, drafts, len(out), out[st.num_tokens:],
                             req.sampling_params.max_tokens or 1 << 30, share))
        if not rows:
            return None
        _share(rows, requests)
        self._pending = self._pool.submit(self._masks, rows)
        return self._pending

    def _masks(self, rows: list[_Row]) -> dict[str, torch.Tensor]:
        import llguidance as llg
        import llguidance.torch as llt

        if self._executor is None:     # only this pool's one thread gets here: no lock
            self._executor = llg.LLExecutor(num_threads=self._threads)
        for r in rows:
            failed = r.grammar.error
            r.grammar.sync_to(r.num_output, r.unseen)
            if r.grammar.error is not None and failed is None:
                self._failures[r.request_id] = r.grammar.error
        total = sum(len(r.drafts) + 1 for r in rows)
        out = bitmask.allocate(total, self.vocab_size)          # [sum P, W], all allowed
        plain: list[tuple[llg.LLMatcher, int]] = []
        drafted: list[tuple[llg.LLMatcher, int, list[int]]] = []
        spans: dict[str, tuple[int, int]] = {}
        ending: list[tuple[RequestGrammar, int, int]] = []
        first_of: dict[tuple, int] = {}     # a shared state's row that computes its mask
        copies: list[tuple[int, int]] = []
        at = 0
        for r in rows:
            st = r.grammar
            spans[r.request_id] = (at, len(r.drafts) + 1)
            if st.done:
                self._eos_only(out[at:at + len(r.drafts) + 1])
            elif r.drafts:
                drafted.append((st.matcher, at, r.drafts))
            elif r.share is not None and r.share in first_of:
                copies.append((first_of[r.share], at))
            else:
                if r.share is not None:
                    first_of[r.share] = at
                plain.append((st.matcher, at))
                if st.list_end is not None:     # (a verify row's drafts go unrestricted)
                    ending.append((st, at, r.max_tokens))
            at += len(r.drafts) + 1
        if plain:
            llt.fill_next_token_bitmask_par(self._executor, plain, out)
        if drafted:
            llt.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, out)
        if copies:
            src, dst = zip(*copies)
            out[list(dst)] = out[list(src)]
        for st, row, max_tokens in ending:
            st.list_end.restrict(st.matcher, out[row], st.num_tokens, max_tokens)
        return {rid: out[a:a + n] for rid, (a, n) in spans.items()}

    def take_failures(self) -> dict[str, str]:
        """Requests whose matcher failed since the last call (after the step's masks): the
        engine ends them with an error rather than let them finish unconstrained."""
        failed, self._failures = self._failures, {}
        return failed

    def _eos_only(self, rows: torch.Tensor) -> None:
        rows.zero_()
        as_bytes = rows.view(torch.uint8)        # little-endian: id i is bit i % 8 of byte i // 8
        for e in self._eos:
            if e < self.vocab_size:
                as_bytes[:, e // 8] |= 1 << (e % 8)

    def advance(self, sampled: Mapping[str, list[SampledToken]]) -> None:
        """Feed each constrained request its new tokens (accepted drafts + the last one) now,
        for `trim_drafts`; without speculation the next `prepare` does it off the critical
        path."""
        for rid, tokens in sampled.items():
            st = self._grammars.get(rid)
            if st is not None and st.error is None:
                st.accept([t.token_id for t in tokens])
                if st.error is not None:
                    self._failures[rid] = st.error

    def trim_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """Drop drafts from the first one the grammar refuses (they could only be rejected)."""
        st = self._grammars.get(request_id)
        if st is None or not drafts:
            return drafts
        return drafts[:st.valid_prefix(drafts)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Row:
    """One sampling row of a step, with what its grammar has not consumed yet (a copy taken
    on the engine thread, so the mask job may run on another)."""

    request_id: str
    grammar: RequestGrammar
    drafts: list[int]
    num_output: int
    unseen: list[int]
    max_tokens: int
    share: tuple | None       # rows with equal keys have equal matcher states: one mask


def _share(rows: list[_Row], requests: Mapping[str, Request]) -> None:
    """A matcher's state is its grammar and the tokens it consumed, nothing else: rows whose
    grammar and output agree (a request's n sequences before they diverge, or requests with
    a common schema at their first token) get one mask. The outputs are compared only
    within a (grammar, length) bucket of more than one row."""
    buckets: dict[tuple, list[_Row]] = {}
    for r in rows:
        if r.share is not None:
            buckets.setdefault(r.share, []).append(r)
    for key, group in buckets.items():
        if len(group) == 1:
            group[0].share = None
            continue
        for r in group:
            r.share = (key, tuple(requests[r.request_id].output_token_ids))
