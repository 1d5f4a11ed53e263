"""`kdaserve bench spec`: decode speed with and without speculative decoding, side by side in
one run, greedy, on the same prompts; outputs must be token-identical."""

from __future__ import annotations

import argparse
import json
import time

import torch

from kdaserve.assets import default_model_path
from kdaserve.engine.llm import LLM
from kdaserve.request import SamplingParams

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo! wherefore art thou", "KING HENRY V:\nOnce more",
           "HAMLET:\nTo be, or not to be", "First Citizen:\nBefore we proceed",
           "MACBETH:\nIs this a dagger", "PORTIA:\nThe quality of mercy", "LEAR:\nBlow, winds"]


def _timed(llm: LLM, prompts: list[str], sp: SamplingParams, batch: int
           ) -> tuple[float, int, list[list[int]]]:
    """Runs prompts in groups of `batch` concurrent requests; returns (seconds, tokens, ids)."""
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], sp, use_tqdm=False)
    dt = time.perf_counter() - start
    ids = [o.outputs[0].token_ids for o in outs]
    return dt, sum(len(x) for x in ids), ids


def _counters(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.scheduler
    return s.num_draft_tokens, s.num_accepted_tokens, s.num_verify_rows


def measure(base: LLM, spec: LLM, prompts: list[str], max_tokens: int, batch: int) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _timed(base, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), 1)   # warm-up
    _timed(spec, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), 1)
    t_base, n_base, ids_base = _timed(base, prompts, sp, batch)
    before = _counters(spec)
    t_spec, n_spec, ids_spec = _timed(spec, prompts, sp, batch)
    drafted, accepted, rows = (a - b for a, b in zip(_counters(spec), before))
    base_rate, spec_rate = n_base / t_base, n_spec / t_spec
    return {
        "batch": batch, "baseline_tok_s": round(base_rate, 1), "spec_tok_s": round(spec_rate, 1),
        "speedup": round(spec_rate / base_rate, 3),
        # tokens a verification yields: accepted drafts + the corrected/bonus token
        "mean_accepted_tokens": round((accepted + rows) / rows, 3) if rows else 1.0,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "drafted": drafted, "accepted": accepted, "verifications": rows,
        "identical": ids_base == ids_spec,
    }


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model = args.model or str(default_model_path())
    base = LLM(model, enable_prefix_caching=False)
    result: dict = {"model": model, "method": args.method, "k": args.k,
                    "max_tokens": args.max_tokens, "threads": args.threads}
    spec = LLM(model, enable_prefix_caching=False, speculative_method=args.method,
               num_speculative_tokens=args.k, speculative_model=args.draft)
    prompts = PROMPTS[: args.num_prompts]
    result.update(measure(base, spec, prompts, args.max_tokens, 1))
    for b in args.batches:
        many = (PROMPTS * (b // len(PROMPTS) + 1))[:b]
        result[f"batch{b}"] = measure(base, spec, many, args.max_tokens, b)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None, help="DSpark draft directory (default: <model>/draft)")
    p.add_argument("--method", choices=("dspark", "ngram"), default="dspark")
    p.add_argument("--k", type=int, default=7, help="drafts per step")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--batches", type=int, nargs="*", default=[8, 32])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
