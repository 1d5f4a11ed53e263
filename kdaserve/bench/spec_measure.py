"""bench spec's side-by-side measurement: each group of concurrent requests runs on the plain
and the speculative side in turn, repeat after repeat, each side first in every other repeat;
each side's fastest run of each group counts, and each repeat's pair gives one paired ratio
(bench/spec_stats.py). The plain side is the speculative engine with speculation switched off
(`speculation_off`)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kdaserve.bench.spec_stats import Blocks, Run, paired_speed_ci
from kdaserve.engine.llm import LLM
from kdaserve.request import SamplingParams


def timed_run(llm: LLM, prompts: list[str], params: list[SamplingParams]
              ) -> tuple[float, int, list[list[int]], list[Blocks], Run]:
    """Runs the prompts as concurrent requests; returns (seconds, tokens, ids, each
    request's (accepted drafts, verified blocks), the decode alone: (seconds from the first
    first token to the last token, tokens after each request's first))."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - start
    comps = [o.outputs[0] for o in outs]
    blocks = [(round((c.acceptance_length - 1.0) * c.spec_verifications)
               if c.acceptance_length else 0, c.spec_verifications) for c in comps]
    ids = [c.token_ids for c in comps]
    tokens = sum(len(x) for x in ids)
    decode = (max(o.metrics.last_token_time for o in outs)
              - min(o.metrics.first_token_time for o in outs), tokens - len(outs))
    return dt, tokens, ids, blocks, decode


@contextlib.contextmanager
def speculation_off(llm: LLM) -> Iterator[LLM]:
    """The speculative engine as a plain one: no speculation policy and no proposer, so it
    schedules, bursts, captures and samples exactly as an engine built without speculation,
    over the same weights and the same cache memory. Two engines differ by more than that:
    two loads of one demo read 2-6% apart, and two engines sharing one model still read up
    to 7% apart at batch 1 (docs/benchmarks.md). Between requests only; the drafter forgets
    its context afterwards (the plain steps wrote slots it was not told of)."""
    engine = llm.engine
    if engine.has_unfinished():
        raise RuntimeError("speculation is switched off between requests only")
    sched, runner = engine.scheduler, engine.runner
    policy, proposer = sched.spec_policy, runner.proposer
    sched.spec_policy, runner.proposer = None, None
    try:
        yield llm
    finally:
        sched.spec_policy, runner.proposer = policy, proposer
        if proposer is not None:
            proposer.forget_context()


def spec_counters(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.scheduler
    return s.num_draft_tokens, s.num_accepted_tokens, s.num_verify_rows


# the sampled rows' defaults: the demos' generation_config.json
SAMPLED_TEMPERATURE, SAMPLED_TOP_P = 0.8, 0.95


def row_params(mode: str, defaults: dict, n: int, max_tokens: int,
               temperature: float = SAMPLED_TEMPERATURE, top_p: float = SAMPLED_TOP_P
               ) -> list[SamplingParams]:
    if mode == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * n
    fields = {"temperature": temperature, "top_p": top_p, **{
        k: v for k, v in defaults.items() if k in ("top_k", "min_p", "repetition_penalty")}}
    return [SamplingParams(**fields, max_tokens=max_tokens, ignore_eos=True, seed=1000 + i)
            for i in range(n)]


@dataclass
class _Best:
    """One engine's fastest run of each group of concurrent requests."""

    seconds: list[float]
    # each group's counted run: tokens, ids, each request's blocks, engine steps
    runs: list[tuple[int, list[list[int]], list[Blocks], int] | None]
    totals: list[float] = field(default_factory=list)     # each repeat's seconds, all groups
    tokens: list[int] = field(default_factory=list)       # each repeat's tokens, all groups
    decode: list[list[float]] = field(default_factory=list)   # each repeat's decode (s, tokens)

    @classmethod
    def of(cls, groups: int) -> _Best:
        return cls([float("inf")] * groups, [None] * groups)

    def time(self, llm: LLM, g: int, prompts: list[str], params: list[SamplingParams],
             plain: bool = False) -> None:
        """Runs group g once, into the current repeat's totals (`new_repeat`)."""
        steps0 = llm.engine.stats.steps
        with speculation_off(llm) if plain else contextlib.nullcontext():
            t, n, ids, blocks, (dt, dn) = timed_run(llm, prompts, params)
        if t < self.seconds[g]:
            self.seconds[g], self.runs[g] = t, (n, ids, blocks, llm.engine.stats.steps - steps0)
        self.totals[-1] += t
        self.tokens[-1] += n
        self.decode[-1][0] += dt
        self.decode[-1][1] += dn

    def new_repeat(self) -> None:
        self.totals.append(0.0)
        self.tokens.append(0)
        self.decode.append([0.0, 0])

    def repeats(self) -> list[tuple[float, int]]:
        return list(zip(self.totals, self.tokens))

    def decode_repeats(self) -> list[tuple[float, int]]:
        return [(t, n) for t, n in self.decode]

    def counted(self) -> tuple[float, int, list[list[int]], list[Blocks], int]:
        runs = [r for r in self.runs if r is not None]
        return (sum(self.seconds), sum(r[0] for r in runs), [i for r in runs for i in r[1]],
                [b for r in runs for b in r[2]], sum(r[3] for r in runs))


def measure(base: LLM, spec: LLM, prompts: list[str], params: list[SamplingParams],
            batch: int, greedy: bool, repeats: int = 4) -> dict:
    """Plain and speculative runs of each group of `batch` concurrent requests, alternated
    `repeats` times, each side first in every other repeat; each side's fastest run of each
    group counts (the machine's noise only ever adds time). `base` may be `spec` itself: its
    plain runs then switch speculation off (`speculation_off`). Alternating group by group, not
    whole rows, keeps the two sides of a comparison a fraction of a second apart: this host's
    read rate and clock move over seconds, and rows that verified nothing read 0.94-1.05
    when whole rows alternated."""
    groups = [(prompts[i:i + batch], params[i:i + batch]) for i in range(0, len(prompts), batch)]
    best_base, best_spec = _Best.of(len(groups)), _Best.of(len(groups))
    before = spec_counters(spec)
    same = base is spec
    sides = ((best_base, base, same), (best_spec, spec, False))
    for r in range(repeats):
        best_base.new_repeat()
        best_spec.new_repeat()
        for g, (ps, pa) in enumerate(groups):
            # who goes first alternates: of two identical plain engines, the one run second
            # on the same requests read 1-5% faster (A/A, docs/benchmarks.md)
            for best, llm, plain in (sides[::-1] if r % 2 else sides):
                best.time(llm, g, ps, pa, plain=plain)
    t_base, n_base, ids_base, _, steps_base = best_base.counted()
    t_spec, n_spec, ids_spec, blocks_spec, steps_spec = best_spec.counted()
    drafted, accepted, rows = (a - b for a, b in zip(spec_counters(spec), before))
    base_rate, spec_rate = n_base / t_base, n_spec / t_spec
    out = {
        "batch": batch, "requests": len(prompts), "baseline_tok_s": round(base_rate, 1),
        "spec_tok_s": round(spec_rate, 1), "speedup": round(spec_rate / base_rate, 3),
        # the plain engine against itself: its median repeat over the counted figure. A
        # speedup within this of 1 is the host's noise, not the drafter's
        "baseline_spread": round(statistics.median(best_base.totals) / t_base - 1.0, 3),
        # repeat by repeat (the two sides back to back): the geometric mean ratio and its 95%
        # interval. "Never a net loss" is shown where the interval's low end is >= 0.97
        **dict(zip(("spec_vs_plain_paired", "spec_vs_plain_ci95_low", "spec_vs_plain_ci95_high"),
                   paired_speed_ci(best_base.repeats(), best_spec.repeats()))),
        # the same over the decode alone (after each request's first token): a long prompt's
        # prefill, the same work on both sides, would otherwise pull the ratio towards 1
        **dict(zip(("decode_spec_vs_plain_paired", "decode_spec_vs_plain_ci95_low",
                    "decode_spec_vs_plain_ci95_high"),
                   paired_speed_ci(best_base.decode_repeats(), best_spec.decode_repeats()))),
        "mean_accepted_tokens": round((accepted + rows) / rows, 3) if rows else 1.0,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "drafted": drafted, "accepted": accepted, "verifications": rows,
        "baseline_tokens": n_base, "spec_tokens": n_spec,      # of the counted (fastest) runs
        # what one engine step costs: sampled vs greedy, speculating vs not
        "baseline_step_ms": round(1000 * t_base / max(steps_base, 1), 3),
        "spec_step_ms": round(1000 * t_spec / max(steps_spec, 1), 3),
        # each request's (accepted drafts, verified blocks) in the counted runs, for the
        # interval of block against token verification (spec_stats.py)
        "request_blocks": blocks_spec,
    }
    if greedy:
        out["identical"] = ids_base == ids_spec
    return out
