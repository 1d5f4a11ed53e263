"""`kdaserve bench long`: what one request costs as its context grows, hybrid vs all-MLA.

For each context length C one greedy request (C - decode_tokens random prompt tokens, chunked
prefill under `--max-num-batched-tokens`, then decode_tokens greedy tokens) runs through the
engine in a fresh child process, so each run's peak RSS is its own. Reported per run: prefill
tok/s, decode TPOT (median step time after the first token; also in process CPU time, which
other work on a shared machine cannot stretch), the cache the request holds per token (its MLA
blocks and KDA slot), RSS before the request (model and cache allocated) and at peak. The same
model made all-MLA (every layer MLA, random weights: only cost is compared) runs the shorter
contexts for the comparison of cache bytes and TPOT.

The default model is a tiny random hybrid configured for 1M positions (a quarter of its layers
MLA, as in Kimi Linear), small enough that the quadratic attention of a 1M-token prefill ends in
tens of minutes on a few CPU cores; `--model DIR` measures a checkpoint instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kdaserve.bench.long_model import SHAPES, make_model_dir
from kdaserve.ops.cpu_isa import cpu_isa

CONTEXTS = (1024, 16384, 131072, 1048576)
MLA_CONTEXTS = (1024, 16384, 131072)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure(model_dir: str, context: int, decode_tokens: int, chunk: int, cache_memory: int,
            threads: int = 0, seed: int = 0) -> dict:
    """One request reaching `context` tokens: context - decode_tokens prompt tokens, then
    decode_tokens greedy ones (so a 1M context fits a model of 1M positions), timed per engine
    step in this process."""
    import torch

    from kdaserve.engine.llm import LLM
    from kdaserve.request import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    logging.getLogger("kdaserve").setLevel(logging.WARNING)
    total = context
    n_prompt = context - decode_tokens
    from kdaserve.cache.spec import specs_for
    from kdaserve.model.registry import load_config

    latent, state = specs_for(load_config(model_dir), 16, "float32")
    latent_bytes, slot_bytes = latent.bytes_per_token, state.bytes_per_slot
    if not cache_memory:  # what this request needs (a bigger pool only adds page-table objects)
        cache_memory = (total + 16) * latent_bytes + slot_bytes + (1 << 20)
    llm = LLM(model_dir, max_model_len=total, cache_memory=cache_memory,
              max_num_batched_tokens=chunk, max_num_seqs=1, enable_prefix_caching=False)
    eng = llm.engine
    vocab = eng.model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (n_prompt,), generator=g).tolist()
    # warm-up: one-time costs (kernel loading, first calls) are not the context's
    llm.generate([{"prompt_token_ids": prompt[:256]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    runs = [(eng, prompt)]
    if context > BASE_CONTEXT:
        # a second engine of the same model decodes a BASE_CONTEXT request step by step in
        # alternation with this one: this VM's speed drifts between runs minutes apart (and
        # after minutes of prefill) by more than the growth measured, so the TPOT ratio is
        # taken side by side (the run at BASE_CONTEXT is still reported as its own row)
        base = LLM(model_dir, max_model_len=BASE_CONTEXT, max_num_seqs=1,
                   cache_memory=(BASE_CONTEXT + 16) * latent_bytes + slot_bytes + (1 << 20),
                   enable_prefix_caching=False)
        runs.append((base.engine, prompt[:BASE_CONTEXT - decode_tokens]))
    rss_before = _rss_mb()
    (first, steps, cpu, tokens), *beside = _decode_side_by_side(runs, decode_tokens)
    beside = beside[0] if beside else None
    plan = eng.plan
    held = plan.request_bytes(total)
    n_prompt = len(prompt)     # what was sent, so a short prompt shows in the row
    return {
        "context": context, "layers_mla": len(eng.model.config.mla_layers),
        "layers": eng.model.config.num_hidden_layers, "completed": tokens == decode_tokens,
        "prefill_s": round(first or 0.0, 3),
        "prompt_tokens": n_prompt,
        "prefill_tok_s": round(n_prompt / first, 1) if first else None,
        "tpot_ms": round(statistics.median(steps) * 1e3, 3) if steps else None,
        "tpot_cpu_ms": round(statistics.median(cpu) * 1e3, 3) if cpu else None,
        # the BASE_CONTEXT request decoded in alternation with this one
        "tpot_base_beside_ms": round(statistics.median(beside[1]) * 1e3, 3)
        if beside and beside[1] else None,
        "tpot_cpu_base_beside_ms": round(statistics.median(beside[2]) * 1e3, 3)
        if beside and beside[2] else None,
        "cache_bytes": held, "cache_bytes_per_token": round(held / total, 1),
        "rss_before_mb": round(rss_before, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "threads": torch.get_num_threads(),
    }


BASE_CONTEXT = 1024


def _decode_side_by_side(runs: list, decode_tokens: int) -> list[tuple]:
    """One greedy request per (engine, prompt): each prefilled in turn, then their decode
    steps in alternation. Per request: (seconds to its first token, wall and process-CPU
    seconds of each later step, tokens out)."""
    from kdaserve.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    out = []
    for i, (eng, prompt) in enumerate(runs):
        eng.add_request(f"r{i}", prompt, params)
        start, tokens = time.perf_counter(), 0
        while eng.has_unfinished() and not tokens:
            tokens = sum(len(d.new_token_ids) for d in eng.step())
        out.append([time.perf_counter() - start if tokens else None, [], [], tokens])
    while any(eng.has_unfinished() for eng, _ in runs):
        for (eng, _), rec in zip(runs, out):
            if not eng.has_unfinished():
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            new = sum(len(d.new_token_ids) for d in eng.step())
            t1, c1 = time.perf_counter(), time.process_time()
            if new:
                rec[1].append(t1 - t0)
                rec[2].append(c1 - c0)   # process CPU time: what contention cannot stretch
                rec[3] += new
    return [tuple(r) for r in out]


def _run_child(model_dir: Path, context: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "kdaserve.bench.long", "--child", str(model_dir), str(context),
           str(args.decode_tokens), str(args.max_num_batched_tokens), str(args.cache_memory),
           str(args.threads)]
    if not args.json:
        print(f"... {model_dir.name} at {context} tokens", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if out.returncode != 0:
        return {"context": context, "completed": False, "error": out.stderr.strip()[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarize(hybrid: list[dict], all_mla: list[dict]) -> dict:
    """The issue's keys from the per-context runs."""
    by = {r["context"]: r for r in hybrid if r.get("completed")}
    mla_by = {r["context"]: r for r in all_mla if r.get("completed")}
    both = sorted(set(by) & set(mla_by))
    longest = both[-1] if both else None
    one_m = by.get(1 << 20, {})
    tpot = {c: r.get("tpot_ms") for c, r in by.items()}
    cpu = {c: r.get("tpot_cpu_ms") for c, r in by.items()}
    at_128k = by.get(131072, {})
    return {
        # 128k against 1k decoded right after it in the same process (see measure)
        "tpot_ratio_128k_1k": _ratio(tpot.get(131072), at_128k.get("tpot_base_beside_ms")),
        "tpot_cpu_ratio_128k_1k": _ratio(cpu.get(131072),
                                         at_128k.get("tpot_cpu_base_beside_ms")),
        # 128k against the 1k run's own process, minutes apart
        "tpot_ratio_128k_1k_across_runs": _ratio(tpot.get(131072), tpot.get(1024)),
        "cache_bytes_ratio_vs_mla": _ratio(by[longest]["cache_bytes"],
                                           mla_by[longest]["cache_bytes"]) if longest else None,
        "cache_bytes_ratio_context": longest,
        "tpot_ratio_vs_mla": _ratio(tpot.get(longest), mla_by[longest].get("tpot_ms"))
        if longest else None,
        "completed_1m": bool(one_m.get("completed")),
        "peak_rss_1m_mb": one_m.get("peak_rss_mb"),
    }


def plot(result: dict, path: str) -> None:
    """TPOT and memory against context length, hybrid vs all-MLA, as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for runs, name, color, marker in ((result["hybrid"], "hybrid", "C0", "o"),
                                      (result["all_mla"], "all-MLA", "C1", "s")):
        ok = [r for r in runs if r.get("completed")]
        ctx = [r["context"] for r in ok]
        ax_t.plot(ctx, [r["tpot_ms"] for r in ok], marker + "-", color=color, label=name)
        if all(r.get("tpot_cpu_ms") for r in ok):
            ax_t.plot(ctx, [r["tpot_cpu_ms"] for r in ok], marker + ":", color=color,
                      label=f"{name} (CPU time)")
        ax_m.plot(ctx, [r["cache_bytes"] / 2**20 for r in ok], marker + "-", color=color,
                  label=f"{name} cache held")
        ax_m.plot(ctx, [r["peak_rss_mb"] for r in ok], marker + ":", color=color,
                  label=f"{name} peak RSS")
    for ax, title in ((ax_t, "decode TPOT (ms)"), (ax_m, "memory (MiB, log)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_m.set_yscale("log")
    fig.suptitle(f"kdaserve bench long: {result['model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model directory (default: a tiny random hybrid for 1M positions)")
    p.add_argument("--shape", choices=SHAPES, default="toy",
                   help="the random bench model without --model: toy (about 1 MB of weights, "
                        "fastest to 1M) or proportional (the released Kimi Linear's ratio of "
                        "latent bytes at 128k to weight bytes per token) (default: %(default)s)")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                   help="prompt lengths of the hybrid model (default: %(default)s)")
    p.add_argument("--mla-contexts", default=",".join(map(str, MLA_CONTEXTS)),
                   help="prompt lengths of the all-MLA variant, '' for none "
                        "(default: %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=64,
                   help="greedy tokens after the prompt; TPOT is their median step time")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="prefill chunk (engine step token budget)")
    p.add_argument("--cache-memory", type=int, default=0,
                   help="cache budget in bytes (default: what each request needs)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of each run (default: torch's); 1 keeps timings steady on "
                        "a machine shared with other work")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw TPOT and memory against context length (needs matplotlib)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="no runs: plot (--plot) the result a previous --json run printed")
    p.add_argument("--json", action="store_true", help="print one JSON object only")


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            result = json.loads(f.read().strip().splitlines()[-1])
        if args.plot:
            plot(result, args.plot)
        return 0
    with tempfile.TemporaryDirectory(prefix="kdaserve-bench-long-") as tmp:
        hybrid_dir = make_model_dir(Path(tmp), args.model, all_mla=False, shape=args.shape)
        hybrid = [_run_child(hybrid_dir, c, args) for c in _lengths(args.contexts)]
        all_mla = []
        if _lengths(args.mla_contexts):
            mla_dir = make_model_dir(Path(tmp), args.model, all_mla=True, shape=args.shape)
            all_mla = [_run_child(mla_dir, c, args) for c in _lengths(args.mla_contexts)]
    result = {"model": args.model or f"bench {args.shape} hybrid (kdaserve.bench.long_model."
                                      f"bench_config)",
              "cpu_isa": cpu_isa(), "threads": args.threads or None,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "decode_tokens": args.decode_tokens, **summarize(hybrid, all_mla),
              "hybrid": hybrid, "all_mla": all_mla}
    print(json.dumps(result, indent=None if args.json else 2))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--child":
        model_dir, *nums = sys.argv[2:]
        ctx, dec, chunk, mem, threads = map(int, nums)
        print(json.dumps(measure(model_dir, ctx, dec, chunk, mem, threads)))
        raise SystemExit(0)
    raise SystemExit("run it as `kdaserve bench long`")
