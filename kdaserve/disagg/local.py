"""A prefill and a decode engine in one process, driven as the proxy drives two servers (for
the benchmark and the tests): the prefill engine computes the prompt and the first token and
pushes the cache over its connector; the decode engine imports it and decodes. Many requests
interleave: each engine steps in turn, and a request moves to the decode engine as soon as
its prefill ends."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from kdaserve.disagg.connector import Arrived
from kdaserve.disagg.params import KVTransferParams
from kdaserve.engine.core import EngineCore
from kdaserve.request import SamplingParams

_ids = itertools.count()


@dataclass
class Trace:
    """One request: its output tokens, when each arrived (time.perf_counter), how it ended."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    reason: str | None = None
    error: str | None = None
    start: float = 0.0

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    @property
    def tpot(self) -> float:
        n = len(self.times)
        return (self.times[-1] - self.times[0]) / (n - 1) if n > 1 else 0.0


def run_colocated(eng: EngineCore, prompts: list[list[int]], params: SamplingParams
                  ) -> list[Trace]:
    """All prompts at once on one engine."""
    traces = {f"c{next(_ids)}": Trace(start=time.perf_counter()) for _ in prompts}
    for rid, p in zip(traces, prompts):
        eng.add_request(rid, p, params)
    while eng.has_unfinished():
        take_deltas(eng.step(), traces)
    return list(traces.values())


def run_disaggregated(pre: EngineCore, dec: EngineCore, prompts: list[list[int]],
                      params: SamplingParams,
                      tamper: Callable[[Arrived], Arrived] | None = None,
                      hit_query: bool = True) -> list[Trace]:
    """All prompts at once: the hit query on `dec` (what it holds of each prompt is left out
    of the transfer; `hit_query` False: everything travels), prefill with max_tokens = 1 on
    `pre`, then each goes on to `dec` with the first token. `tamper` rewrites an arrived
    transfer before its request takes it (the mutation test)."""
    traces: dict[str, Trace] = {}
    for p in prompts:
        tid = f"t{next(_ids)}"
        traces[tid] = Trace(start=time.perf_counter())
        pre.add_request(tid, p, export_params(dec, tid, p, params, hit_query))
    by_id = dict(zip(traces, prompts))
    while pre.has_unfinished() or dec.has_unfinished():
        if pre.has_unfinished():
            for d in pre.step():
                tr = traces[d.request_id]
                tr.tokens += d.new_token_ids
                tr.times += [time.perf_counter()] * len(d.new_token_ids)
                if not d.finished:
                    continue
                if tamper is not None and d.finish_reason == "length" and params.max_tokens != 1:
                    inbox = dec.transfer.connector.inbox
                    inbox.put(tamper(inbox.take(d.request_id, 1.0)))
                hand_over(dec, d.request_id, by_id[d.request_id], params, tr, d.finish_reason,
                          d.error)
        if dec.has_unfinished():
            take_deltas(dec.step(), traces, skip_first=True)
    return list(traces.values())


def export_params(dec: EngineCore, tid: str, prompt: list[int], params: SamplingParams,
                  hit_query: bool = True) -> SamplingParams:
    """A request's parameters on the prefill engine, as the proxy writes them: max_tokens = 1
    and where to push its cache, all but what `dec` holds of the prompt (its answer to the hit
    query, pinned there under `tid` until the import takes it)."""
    held = dec.hold_prefix(tid, prompt) if hit_query else 0
    return replace(params, max_tokens=1, kv_transfer=KVTransferParams(
        tid, peer=dec.transfer.address, held_tokens=held))


def hand_over(dec: EngineCore, tid: str, prompt: list[int], params: SamplingParams,
              tr: Trace, reason: str | None, error: str | None) -> None:
    """A request whose prefill ended (`tr` holds its first token and when it came): on to the
    decode engine with that token, unless it ended otherwise or needs no more tokens."""
    if reason != "length" or params.max_tokens == 1:
        tr.reason, tr.error = reason, error
        return
    dec.add_request(tid, prompt, replace(params, kv_transfer=KVTransferParams(
        tid, first_token_id=tr.tokens[0])))
    tr.tokens, tr.times = [], tr.times[:1]      # the decode side repeats the first token


def transfer_counters(eng: EngineCore) -> dict[str, float]:
    """An engine's transfer seconds (pushes, last parts; receives on a decode engine),
    connector counters, steps and prefix-cache hit tokens: subtract two of them for what a
    run moved."""
    return {**asdict(eng.transfer.times), **eng.transfer.metrics(),
            "steps": float(eng.stats.steps), "hit_tokens": float(eng.cache.stats.hit_tokens)}


def counters_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What two transfer_counters readings of one engine differ by."""
    return {k: v - before[k] for k, v in after.items()}


def take_deltas(deltas, traces: dict[str, Trace], skip_first: bool = False) -> None:
    now = time.perf_counter()
    for d in deltas:
        tr = traces[d.request_id]
        new = d.new_token_ids
        if skip_first and not tr.tokens and new:
            tr.tokens += new        # the first token was timed when the prefill side sent it
            tr.times += [now] * (len(new) - 1)
        else:
            tr.tokens += new
            tr.times += [now] * len(new)
        if d.finished:
            tr.reason, tr.error = d.finish_reason, d.error
