"""`kdaserve bench spec`: decode speed with and without speculative decoding, side by side in
one run, on prompts neither the model nor its draft trained on (bench/spec_prompts.py).

The plain side is the speculative engine itself with speculation switched off (`_plain`): the
same weights, cache memory and code paths as an engine built without it, which two engines are
not (docs/benchmarks.md). Two decoding modes, as users call the server: greedy, and sampled
with the model's generation defaults (temperature 0.8, top-p 0.95 and whatever else
generation_config.json sets, e.g. the demo's repetition penalty), fixed seeds. Batch sizes 1, 8
and 32 (concurrent requests). For each: `speedup` (spec tok/s ÷ plain tok/s), `acceptance_rate`
(accepted ÷ proposed drafts), `mean_accepted_tokens` (tokens a verifying row yields: accepted
drafts + 1), and for greedy `identical` (the outputs must be token-identical). Sampled outputs
differ by construction (the random stream is consumed differently); the rejection sampler's
exactness is a unit test.
`acceptance_length` is mean_accepted_tokens under the name the K3 recipe reports it by.
`--rejection-sample-method both` runs a second engine, on the first one's weights, that
verifies by blocks (engine/spec/block_verify.py) on the same prompts and seeds, and reports its
row beside the token rule's, with `block_vs_token_acceptance` (sampled: the ratio of acceptance
lengths) and `block_vs_token_acceptance_ci95`, its paired bootstrap interval over the requests
(bench/spec_stats.py); each row's `request_blocks` lists its requests' (accepted drafts,
verified blocks) in the counted (fastest) runs.
`baseline_spread` is how far the plain engine's median repeat lies from its counted time: the
resolution of `speedup` on this host at that moment. The counters above add up every repeat;
with fixed seeds and `--no-adaptive` each repeat verifies the same blocks, while the adaptive
policy can verify differently from one repeat to the next.
`--input-lens 1024,16384,65536` adds, per mode, a batch-1 row `input<L>` whose prompts are L
tokens long (bench/spec_prompts.py `long_prompt_ids`): the engines' max_model_len is raised to
fit; a length past the model's own limit is reported as {"skipped": why}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kdaserve.assets import default_model_path
from kdaserve.bench.spec_prompts import long_prompt_ids, unseen_prompts
from kdaserve.bench.spec_stats import Blocks, Run, paired_ratio_ci, paired_speed_ci
from kdaserve.engine.llm import LLM
from kdaserve.generation_defaults import generation_defaults
from kdaserve.ops.cpu_isa import cpu_isa
from kdaserve.request import SamplingParams


def _timed(llm: LLM, prompts: list[str], params: list[SamplingParams]
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
def _plain(llm: LLM) -> Iterator[LLM]:
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


def _counters(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.scheduler
    return s.num_draft_tokens, s.num_accepted_tokens, s.num_verify_rows


# the sampled rows' defaults: the demos' generation_config.json
SAMPLED_TEMPERATURE, SAMPLED_TOP_P = 0.8, 0.95


def _params(mode: str, defaults: dict, n: int, max_tokens: int,
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
        with _plain(llm) if plain else contextlib.nullcontext():
            t, n, ids, blocks, (dt, dn) = _timed(llm, prompts, params)
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
    plain runs then switch speculation off (`_plain`). Alternating group by group, not
    whole rows, keeps the two sides of a comparison a fraction of a second apart: this host's
    read rate and clock move over seconds, and rows that verified nothing read 0.94-1.05
    when whole rows alternated."""
    groups = [(prompts[i:i + batch], params[i:i + batch]) for i in range(0, len(prompts), batch)]
    best_base, best_spec = _Best.of(len(groups)), _Best.of(len(groups))
    before = _counters(spec)
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
    drafted, accepted, rows = (a - b for a, b in zip(_counters(spec), before))
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


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model = args.model or str(default_model_path())
    where = {"device": args.device, "dtype": args.dtype}
    if args.input_lens:         # room for the longest prompt, its completion and a block
        where["max_model_len"] = max(4096, max(args.input_lens) + args.max_tokens + args.k + 1)
    methods = ["token", "block"] if args.rejection_sample_method == "both" else [
        args.rejection_sample_method]
    specs: dict[str, LLM] = {}
    for m in methods:       # one model in memory; each engine is its own plain baseline
        specs[m] = LLM(model, shared_weights=specs.get("token"), enable_prefix_caching=False,
                       speculative_method=args.method, num_speculative_tokens=args.k,
                       speculative_model=args.draft, speculative_adaptive=not args.no_adaptive,
                       speculative_rejection_sample_method=m, **where)
    spec = specs[methods[0]]
    prompts = unseen_prompts()
    defaults = generation_defaults(model)
    result: dict = {"model": model, "method": args.method, "k": args.k,
                    "rejection_sample_method": args.rejection_sample_method,
                    "adaptive": not args.no_adaptive, "max_tokens": args.max_tokens,
                    "repeats": args.repeats,
                    "cpu_isa": cpu_isa(), "threads": args.threads, "device": args.device,
                    "dtype": args.dtype,
                    "prompts": "unseen (bench/spec_prompts.py)"}
    warm = [SamplingParams(temperature=0.0, max_tokens=8)]
    for llm in specs.values():
        _timed(llm, prompts[:1], warm)
        with _plain(llm):
            _timed(llm, prompts[:1], warm)
    for mode in args.modes:
        rows = {}
        for b in [1, *args.batches]:
            n = args.num_prompts if b == 1 else b
            many = (prompts * (n // len(prompts) + 1))[:n]
            params = _params(mode, defaults, n, args.max_tokens, args.temperature,
                             args.top_p)
            row = rows[f"batch{b}"] = measure(spec, spec, many, params, b,
                                              greedy=mode == "greedy", repeats=args.repeats)
            row["acceptance_length"] = row["mean_accepted_tokens"]
            if "block" in specs and spec is not specs["block"]:
                blk = measure(specs["block"], specs["block"], many, params, b,
                              greedy=mode == "greedy", repeats=args.repeats)
                blk["acceptance_length"] = blk["mean_accepted_tokens"]
                row["block"] = blk
                row["block_vs_token_acceptance"] = round(
                    blk["acceptance_length"] / row["acceptance_length"], 3)
                row["block_vs_token_acceptance_ci95"] = paired_ratio_ci(
                    row["request_blocks"], blk["request_blocks"])
        for n_in in args.input_lens:
            row = rows[f"input{n_in}"] = _long_row(spec, n_in, mode, defaults, args)
            if "block" in specs and spec is not specs["block"] and "skipped" not in row:
                row["block"] = _long_row(specs["block"], n_in, mode, defaults, args)
        result[mode] = rows
        if mode == "sampled":
            result["sampling"] = {k: v for k, v in vars(_params(
                mode, defaults, 1, 1, args.temperature, args.top_p)[0]).items()
                                  if k in ("temperature", "top_p", "top_k", "min_p",
                                           "repetition_penalty")}
    for mode, prefix in (("greedy", ""), ("sampled", "sampled_")):
        rows = result.get(mode, {})
        if "batch1" in rows:
            result[f"{prefix}speedup"] = rows["batch1"]["speedup"]
        if "batch32" in rows:
            result[f"{prefix}batch32_speedup"] = rows["batch32"]["speedup"]
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _long_row(spec: LLM, n_in: int, mode: str, defaults: dict, args: argparse.Namespace
              ) -> dict:
    """Batch 1, `--num-prompts` requests whose prompts are n_in tokens long."""
    limit = min(spec.engine.config.scheduler.max_model_len,
                spec.engine.model.config.max_position_embeddings)
    if n_in + args.max_tokens + args.k + 1 > limit:
        return {"input_len": n_in, "skipped": f"{n_in} prompt tokens + {args.max_tokens} "
                f"generated + {args.k + 1} verified exceed the model's limit of {limit}"}
    encode = spec.tokenizer.encode
    prompts = [{"prompt_token_ids": long_prompt_ids(encode, n_in, i)}
               for i in range(args.num_prompts)]
    params = _params(mode, defaults, args.num_prompts, args.max_tokens, args.temperature,
                     args.top_p)
    row = measure(spec, spec, prompts, params, 1, greedy=mode == "greedy",
                  repeats=args.repeats)
    row["input_len"] = n_in
    row["acceptance_length"] = row["mean_accepted_tokens"]
    return row


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=4,
                   help="plain and speculative runs of each group of concurrent requests, "
                        "alternated; the fastest of each counts")
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None, help="DSpark draft directory (default: <model>/draft)")
    p.add_argument("--method", choices=("dspark", "ngram"), default="dspark")
    p.add_argument("--k", type=int, default=7, help="most drafts per step")
    p.add_argument("--rejection-sample-method", choices=("token", "block", "both"),
                   default="block", help="verification rule; both: a row for each, the same "
                   "prompts and seeds")
    p.add_argument("--no-adaptive", action="store_true",
                   help="always verify k drafts (adaptive speculation off)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=4, help="requests at batch 1")
    p.add_argument("--batches", type=int, nargs="*", default=[8, 32])
    p.add_argument("--modes", nargs="+", choices=("greedy", "sampled"),
                   default=["greedy", "sampled"])
    p.add_argument("--temperature", type=float, default=SAMPLED_TEMPERATURE,
                   help="the sampled rows' temperature (top_k, min_p and repetition_penalty "
                   "come from the model's generation_config.json)")
    p.add_argument("--top-p", type=float, default=SAMPLED_TOP_P,
                   help="the sampled rows' top_p")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (both engines)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--input-lens", type=_lengths, default=[],
                   help="comma-separated prompt lengths in tokens for extra batch-1 rows, e.g. "
                   "1024,16384,65536 (the K3 recipe's long-input figures; default: none)")
    p.add_argument("--json", action="store_true")
