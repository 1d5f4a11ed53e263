"""`kdaserve bench spec`: decode speed with and without speculative decoding, side by side in
one run, on prompts neither the model nor its draft trained on (bench/spec_prompts.py).

The plain side is the speculative engine itself with speculation switched off
(bench/spec_measure.py `speculation_off`): the same weights, cache memory and code paths as an
engine built without it, which two engines are not (docs/benchmarks.md). Two decoding modes, as
users call the server: greedy, and sampled with the model's generation defaults (temperature
0.8, top-p 0.95 and whatever else generation_config.json sets, e.g. the demo's repetition
penalty), fixed seeds. Batch sizes 1, 8 and 32 (concurrent requests). For each: `speedup` (spec
tok/s ÷ plain tok/s), `acceptance_rate` (accepted ÷ proposed drafts), `mean_accepted_tokens`
(tokens a verifying row yields: accepted drafts + 1), and for greedy `identical` (the outputs
must be token-identical). Sampled outputs differ by construction (the random stream is consumed
differently); the rejection sampler's exactness is a unit test.
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
tokens long, timed after the prompt is cached (bench/spec_long.py says why); a length past the
model's own limit is reported as {"skipped": why}. The side-by-side timing itself is
bench/spec_measure.py.
"""

from __future__ import annotations

import argparse
import json

import torch

from kdaserve.assets import default_model_path
from kdaserve.bench.spec_long import long_engines, long_row
from kdaserve.bench.spec_measure import (SAMPLED_TEMPERATURE, SAMPLED_TOP_P, measure,
                                         row_params, speculation_off, timed_run)
from kdaserve.bench.spec_prompts import unseen_prompts
from kdaserve.bench.spec_stats import paired_ratio_ci
from kdaserve.engine.llm import LLM
from kdaserve.generation_defaults import generation_defaults
from kdaserve.ops.cpu_isa import cpu_isa
from kdaserve.request import SamplingParams


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model = args.model or str(default_model_path())
    kw = {"device": args.device, "dtype": args.dtype, "speculative_method": args.method,
          "num_speculative_tokens": args.k, "speculative_model": args.draft,
          "speculative_adaptive": not args.no_adaptive}
    methods = ["token", "block"] if args.rejection_sample_method == "both" else [
        args.rejection_sample_method]
    specs: dict[str, LLM] = {}
    for m in methods:       # one model in memory; each engine is its own plain baseline
        specs[m] = LLM(model, shared_weights=specs.get("token"), enable_prefix_caching=False,
                       speculative_rejection_sample_method=m, **kw)
    spec = specs[methods[0]]
    longs = long_engines(model, spec, methods, args, kw) if args.input_lens else {}
    prompts = unseen_prompts()
    defaults = generation_defaults(model)
    result: dict = {"model": model, "method": args.method, "k": args.k,
                    "rejection_sample_method": args.rejection_sample_method,
                    "adaptive": not args.no_adaptive, "max_tokens": args.max_tokens,
                    "repeats": args.repeats, "long_repeats": args.long_repeats,
                    "cpu_isa": cpu_isa(), "threads": args.threads, "device": args.device,
                    "dtype": args.dtype,
                    "prompts": "unseen (bench/spec_prompts.py)"}
    warm = [SamplingParams(temperature=0.0, max_tokens=8)]
    for llm in [*specs.values(), *longs.values()]:
        timed_run(llm, prompts[:1], warm)
        with speculation_off(llm):
            timed_run(llm, prompts[:1], warm)
    for mode in args.modes:
        rows = {}
        for b in [1, *args.batches]:
            n = args.num_prompts if b == 1 else b
            many = (prompts * (n // len(prompts) + 1))[:n]
            params = row_params(mode, defaults, n, args.max_tokens, args.temperature,
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
            row = rows[f"input{n_in}"] = long_row(longs[methods[0]], n_in, mode, defaults, args)
            if "block" in longs and methods[0] != "block" and "skipped" not in row:
                row["block"] = long_row(longs["block"], n_in, mode, defaults, args)
        result[mode] = rows
        if mode == "sampled":
            result["sampling"] = {k: v for k, v in vars(row_params(
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
    p.add_argument("--long-repeats", type=int, default=16,
                   help="timed pairs of each long-input row, after its prompt is cached")
    p.add_argument("--json", action="store_true")
