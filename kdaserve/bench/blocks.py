"""`kdaserve bench blocks`: where a CPU decode step's time goes, per fused block.

Runs decode steps through the engine (the bundled Kimi Linear demo unless --model), with each
compiled block call of the fused decode path (kdaserve/model/fused_decode.py) timed in place:
the token mixers (KDA, MLA), the feed-forwards (dense MLP, MoE), K3's residual mixes and the
LM head, in microseconds per step, beside the step's wall time, the fused forward's, and
what is left (scheduling, sampling, the engine's Python; given where one thread calls the
blocks: where the rows are split over threads, the block figures sum over those threads).
Prompts are random token ids;
generation is greedy with EOS ignored. The prompts' prefill is run and timed apart.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import Counter

import torch

from kdaserve.assets import kimi_linear_demo_path
from kdaserve.engine.llm import LLM
from kdaserve.ops.cpu_isa import cpu_isa
from kdaserve.request import SamplingParams

_BLOCKS = ("kda", "mla", "mlp", "moe", "mix", "head")


class _Timed:
    """The decoder's kernel table with each block's call timed."""

    def __init__(self, kernels, totals: Counter, threads: set) -> None:
        self._k, self._totals, self._threads = kernels, totals, threads

    def __getattr__(self, name: str):
        fn = getattr(self._k, name)
        if name not in _BLOCKS:
            return fn

        def timed(*args):
            t = time.perf_counter_ns()
            fn(*args)
            self._totals[name] += time.perf_counter_ns() - t
            self._threads.add(threading.get_ident())
        return timed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the bundled demo)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quantization", default=None, choices=("int8", "int4"))
    p.add_argument("--quantization-group-size", type=int, default=128,
                   help="input columns per scale of --quantization (32: Q4_0's groups)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--input", type=int, default=128)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="best of N runs per batch size")
    p.add_argument("--json", action="store_true")
    p.add_argument("--against-csrc", default=None, metavar="DIR",
                   help="also time another build of the blocks from DIR (a csrc/ directory, "
                        "e.g. an older checkout's kdaserve/ops/csrc), alternating every "
                        "decode step with this one (bench/blocks_ab.py)")
    p.add_argument("--against-cflags", default=None, metavar="FLAGS",
                   help="the other build's extra compiler flags (-D of a tunable; write "
                        "--against-cflags=-DNAME=V), with or without --against-csrc")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch.split(",") if b.strip()]
    llm = LLM(args.model or str(kimi_linear_demo_path()), dtype=args.dtype,
              quantization=args.quantization,
              quantization_group_size=args.quantization_group_size, max_num_seqs=max(sizes),
              max_model_len=args.input + args.output + 16, max_num_batched_tokens=4096,
              enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    g = torch.Generator().manual_seed(0)
    report: dict = {"cpu_isa": cpu_isa(), "threads": args.threads, "dtype": args.dtype,
                    "quantization": args.quantization,
                    "quantization_group_size": args.quantization_group_size, "batches": {}}

    def go(prompts: list[list[int]], out: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t

    against = bool(args.against_csrc) or args.against_cflags is not None
    alt = None
    if against:
        from kdaserve.bench.memory_bound import read_rate

        report["a"] = {"csrc": None, "cflags": os.environ.get("KDASERVE_KERNEL_CFLAGS", "")}
        report["b"] = {"csrc": args.against_csrc, "cflags": args.against_cflags or ""}
        report["read_bytes_per_s"] = [round(read_rate(args.threads))]
    totals: Counter = Counter()
    callers: set = set()
    for b in sizes:
        prompts = torch.randint(4, llm.engine.model_config.vocab_size, (b, args.input),
                                generator=g).tolist()
        go(prompts, 2)                                   # the decoder is built, kernels warm
        if not runner._fused:
            report["batches"][str(b)] = {"error": "the fused decode path does not apply"}
            continue
        dec = runner._fused
        if against:
            if alt is None:          # the other build, once for every batch size
                from kdaserve.bench.blocks_ab import Alternating, tables, weights_of

                alt = Alternating(tables(weights_of(runner.model), args.against_csrc,
                                         args.against_cflags or ""))
            report["batches"][str(b)] = _alternated(dec, alt, prompts, go, args.output,
                                                    args.repeats)
            continue
        dec.k = _Timed(dec.k if not isinstance(dec.k, _Timed) else dec.k._k, totals, callers)
        best: dict | None = None
        for _ in range(args.repeats):
            prefill = go(prompts, 1)
            totals.clear()
            callers.clear()
            whole = go(prompts, args.output + 1) - prefill
            steps = args.output
            row = {"tok_s": round(b * steps / whole, 1), "step_us": round(whole / steps * 1e6),
                   **{f"{k}_us": round(totals[k] / steps / 1e3) for k in _BLOCKS if totals[k]}}
            row["blocks_us"] = round(sum(totals.values()) / steps / 1e3)
            # rows split over threads (fused_rows.split_parts): each thread's block calls are
            # timed, so the block figures sum over them and exceed the step's wall time
            row["calling_threads"] = len(callers)
            if len(callers) == 1:
                row["outside_blocks_us"] = row["step_us"] - row["blocks_us"]
            if best is None or row["step_us"] < best["step_us"]:
                best = row
        report["batches"][str(b)] = best
    if against:
        report["read_bytes_per_s"].append(round(read_rate(args.threads)))
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def _alternated(dec, alt, prompts: list[list[int]], go, output: int, repeats: int) -> dict:
    """Build A (this one) and build B (--against-*) every other decode step (blocks_ab.py)
    over `repeats` runs of the prompts; the decoder keeps build A after."""
    dec.k = alt
    go(prompts, 3)
    alt.clear()
    for _ in range(repeats):
        go(prompts, output + 1)
    dec.k = alt.tables[0]
    return alt.report()
