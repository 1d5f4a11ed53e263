"""What the engine owes each request it runs: which client request and completion it is, its
detokenizer, how many tokens it has emitted, and whose prompt logprobs it takes
(prompt_sharing.py). It turns a step's touched requests into their deltas, and ends requests
with a final one (an error, the length limit, a failed grammar). EngineCore (core.py) owns
one; the scheduler holds the requests themselves."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kdaserve.detokenizer import IncrementalDetokenizer
from kdaserve.engine.prompt_sharing import PromptScores
from kdaserve.outputs import RequestDelta
from kdaserve.request import Request, RequestStatus, SamplingParams

if TYPE_CHECKING:
    from kdaserve.engine.core import EngineStats
    from kdaserve.engine.scheduler import Scheduler

logger = logging.getLogger("kdaserve")


@dataclass
class _Tracked:
    parent: str
    index: int
    detok: IncrementalDetokenizer | None
    emitted_tokens: int = 0
    prompt_from: str | None = None  # whose prompt logprobs it takes (prompt_sharing.py)
    prompt_k: int | None = None     # the top-k it asked for (scored itself if that one ends)


class RequestTracker:
    def __init__(self, scheduler: Scheduler, stats: EngineStats) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.scores = PromptScores()         # prompt logprobs scored once per prompt
        self._tracked: dict[str, _Tracked] = {}
        self._children: dict[str, list[str]] = {}

    def has_request(self, request_id: str) -> bool:
        """A client request id in use (its completions still tracked)."""
        return request_id in self._children

    def parent(self, rid: str) -> str:
        return self._tracked[rid].parent if rid in self._tracked else rid

    def track(self, cid: str, request_id: str, index: int,
              detok: IncrementalDetokenizer | None, leader: str | None, follows: bool,
              prompt_k: int | None, key: tuple | None) -> None:
        """Completion `index` of client request `request_id`, scheduled as `cid`."""
        self._tracked[cid] = _Tracked(request_id, index, detok,
                                      prompt_from=leader if follows else None,
                                      prompt_k=prompt_k)
        if follows:
            self.scores.follow(cid, leader)
        elif leader == cid:
            self.scores.lead(cid, key)

    def group(self, request_id: str, children: list[str]) -> None:
        self._children[request_id] = children

    def abort(self, request_id: str) -> None:
        for cid in self._children.pop(request_id, []):
            self.scheduler.abort(cid)
            self._tracked.pop(cid, None)
            self._orphaned(self.scores.forget(cid))

    # ---- deltas -------------------------------------------------------------------------------
    def deltas(self, touched: Iterable[Request], unsent: dict[str, str],
               grammar_errors: dict[str, str]) -> list[RequestDelta]:
        """The deltas of a step's touched requests (`unsent`: those whose cache could not be
        sent, with why; `grammar_errors`: those whose grammar failed), then the final ones the
        scheduler owes for requests it ended on its own."""
        deltas = []
        for req in touched:
            rid = req.request_id
            if rid in unsent and rid in self._tracked:
                deltas.append(self.failed(rid, unsent[rid]))
                continue
            why = grammar_errors.get(rid)
            if why is not None and rid in self._tracked:
                # its last token was sampled under an EOS-only mask: never a "stop"
                if rid in self.scheduler.requests:
                    self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
                deltas.append(self.failed(rid, f"the output grammar failed: {why}"))
                continue
            try:
                deltas.append(self._delta(req))
            except Exception as exc:    # e.g. detokenizing: this request's alone
                logger.error("request %s failed while producing its output", rid, exc_info=exc)
                if rid in self.scheduler.requests:
                    self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
                if rid in self._tracked:
                    deltas.append(self.failed(rid, f"{type(exc).__name__}: {exc}"))
                else:
                    self.stats.failed += 1
        # requests the scheduler ended on its own (too large for the cache) owe a final delta
        deltas += [self.final(rid, "length") for rid in self.scheduler.pop_ended()
                   if rid in self._tracked]
        for rid, why in self.scheduler.pop_failed().items():   # their cache never came
            if rid in self._tracked:
                deltas.append(self.failed(rid, why))
        return deltas

    def failed(self, rid: str, error: str) -> RequestDelta:
        """rid's last delta, ending it with `error` (counted as a failed request)."""
        self.stats.failed += 1
        return self.final(rid, "error", error=error)

    def final(self, rid: str, reason: str, error: str | None = None) -> RequestDelta:
        tr = self._tracked[rid]
        text = ""
        if tr.detok is not None and error is None:
            text = tr.detok.flush()
        self._forget(rid)
        return RequestDelta(tr.parent, tr.index, [], text, True, reason, error=error)

    def _delta(self, req: Request) -> RequestDelta:
        tr = self._tracked[req.request_id]
        prompt_lps = None
        if tr.emitted_tokens == 0 and req.sampling_params.prompt_logprobs is not None:
            prompt_lps = req.prompt_logprobs or [None]
            self.scores.scored(req.request_id, list(prompt_lps))   # for its followers
        elif tr.emitted_tokens == 0 and tr.prompt_from is not None:
            prompt_lps = self.scores.take(req.request_id)
        known = req.num_known_outputs         # the rest are in flight (async scheduling)
        new_ids = req.output_token_ids[tr.emitted_tokens:known]
        new_lps = req.output_logprobs[tr.emitted_tokens:] if req.output_logprobs else None
        tr.emitted_tokens = known
        self.stats.generation_tokens += len(new_ids)
        text = ""
        if tr.detok is not None:
            d = tr.detok.push(new_ids)
            text = d.text
            if d.stop_string is not None and not req.is_finished:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.stop_reason = d.stop_string
            if req.is_finished and d.stop_string is None:
                text += tr.detok.flush()
        finished = req.is_finished
        reason = req.status.value if finished else None
        if finished:
            self._forget(req.request_id)
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        return RequestDelta(tr.parent, tr.index, new_ids, text, finished, reason,
                            req.stop_reason if finished else None, new_lps,
                            req.num_prompt_tokens, known,
                            req.num_cached_tokens, prompt_logprobs=prompt_lps,
                            spec_verifications=req.num_spec_verifications if finished else 0,
                            spec_accepted_tokens=req.num_accepted_tokens if finished else 0)

    def _forget(self, rid: str) -> None:
        tr = self._tracked.pop(rid, None)
        if tr is None:
            return
        self._orphaned(self.scores.forget(rid))
        kids = self._children.get(tr.parent)
        if kids is not None and all(k not in self._tracked for k in kids):
            del self._children[tr.parent]

    def _orphaned(self, followers: list[str]) -> None:
        """Followers whose leader ended before scoring the prompt score it themselves (none
        has started: they wait for the leader)."""
        for rid in followers:
            req, tr = self.scheduler.requests.get(rid), self._tracked.get(rid)
            if req is None or tr is None:
                continue
            req.sampling_params = SamplingParams(**{**req.sampling_params.__dict__,
                                                    "prompt_logprobs": tr.prompt_k})
            req.prompt_leader = None
            tr.prompt_from = None
