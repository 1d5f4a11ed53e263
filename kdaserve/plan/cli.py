"""`kdaserve plan --model DIR|config.json --gpu H200 --num-gpus 8 [...]`: prints the plan
(kdaserve/plan/model.py) as a table, or as JSON with --json. With --simulate, the engine's
scheduler serves a workload on that layout in simulated time (kdaserve/plan/simulate.py); with
--calibrate, the simulator is checked against the demo model on this machine
(kdaserve/plan/calibrate.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kdaserve.plan.model import EXPERT_BITS, Layout, plan, recommend, roofline

# the published configs (shared/data), by name: `--model kimi-k3`
PUBLISHED = {p.stem: p for p in (Path(__file__).parent / "configs").glob("*.json")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory, config.json, or a "
                   f"published config by name ({', '.join(sorted(PUBLISHED))})")
    p.add_argument("--gpu", default=None, help="an entry of the hardware table "
                   "(kdaserve/plan/hardware.json: H100, H200, B200, GB300, MI300X, MI355X, "
                   "RTX5090, EPYC-2C)")
    p.add_argument("--hardware", default=None, metavar="FILE",
                   help="a JSON table of more (or changed) entries, same keys")
    p.add_argument("--num-gpus", type=int, default=None, help="GPUs in all")
    p.add_argument("--nodes", type=int, default=None, help="machines (default: from the "
                   "table's GPUs per node)")
    for name in ("tp", "ep", "pp", "dp"):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{name.upper()} size (default: the recommended layout)")
    p.add_argument("--quantization", choices=sorted(EXPERT_BITS), default=None,
                   help="routed experts' format (default: the checkpoint's, else bf16)")
    p.add_argument("--context", type=int, default=131072, help="tokens per request")
    p.add_argument("--acceptance-length", type=float, default=None,
                   help="speculation: mean tokens per verified block (K3 recipe: 2.6-4.7)")
    p.add_argument("--api-price", type=float, default=None,
                   help="$ per million output tokens of the API compared with (break-even)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--json", action="store_true")
    sim = p.add_argument_group("simulation (--simulate) and calibration (--calibrate)")
    sim.add_argument("--simulate", action="store_true",
                     help="serve a workload with the engine's scheduler and cache manager in "
                     "simulated time, each step charged by the roofline")
    sim.add_argument("--calibrate", action="store_true",
                     help="fit the step cost to the demo model's steps on this machine and "
                     "compare the simulator with a measured bench-serve workload (needs no "
                     "--model/--gpu)")
    sim.add_argument("--arrival-rate", type=float, default=None,
                     help="requests per second, Poisson (inf: all at once); --simulate: for "
                     "the whole deployment, split over the dp replicas (default 1; "
                     "--calibrate: 8)")
    sim.add_argument("--num-requests", type=int, default=None,
                     help="requests in the workload (default 200; --calibrate: 24)")
    sim.add_argument("--prompt-len", default="1024", metavar="DIST",
                     help="N, uniform:LO:HI or exp:MEAN (default: %(default)s)")
    sim.add_argument("--output-len", default="256", metavar="DIST",
                     help="N, uniform:LO:HI or exp:MEAN (default: %(default)s)")
    sim.add_argument("--prefix-share", type=float, default=0.0, metavar="P",
                     help="the first P of every prompt is one common prefix (default 0)")
    sim.add_argument("--trace", default=None, metavar="FILE",
                     help="JSON lines {arrival_s, prompt_len, output_len[, shared_prefix_len]} "
                     "instead of the synthetic workload")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--wall-clock", action="store_true",
                     help="--calibrate: measure on the wall clock, not the process's CPU time "
                     "(on a shared machine it counts waiting for a core)")
    sim.add_argument("--max-num-seqs", type=int, default=256)
    sim.add_argument("--max-num-batched-tokens", type=int, default=8192)
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--offload-bytes", type=float, default=0,
                     help="a host-memory offload tier of this many bytes per GPU (default none)")


def run(args: argparse.Namespace) -> int:
    from kdaserve.model.registry import load_config
    from kdaserve.plan.hardware import find, load_table

    if args.calibrate:
        return _calibrate(args)
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "gpu", "num_gpus")
               if getattr(args, k) is None]
    if missing:
        sys.stderr.write(f"error: plan needs {', '.join(missing)} (or --calibrate)\n")
        return 2

    cfg = load_config(PUBLISHED.get(args.model, args.model))
    hw = find(load_table(args.hardware), args.gpu)
    nodes = args.nodes or max(1, -(-args.num_gpus // hw.node_gpus))
    layout = recommend(cfg, hw, args.num_gpus, nodes)
    given = {k: getattr(args, k) for k in ("tp", "ep", "pp", "dp") if getattr(args, k)}
    if given:
        d = {**layout.__dict__, **given, "reason": "as given"}
        d["moe_backend"] = "ep_all2all" if d["ep"] > 1 else "tp_sharded"
        layout = Layout(**d)
    if layout.gpus != args.num_gpus:
        sys.stderr.write(f"error: tp x dp x pp = {layout.gpus}, not --num-gpus "
                         f"{args.num_gpus}\n")
        return 2
    quant = args.quantization or (cfg.experts_quantization or "bf16")
    roof = roofline(cfg, hw, layout, quant)
    p = plan(cfg, hw, layout, quant, args.context, memory_util=args.gpu_memory_utilization,
             acceptance_length=args.acceptance_length, api_price=args.api_price, roof=roof)
    out = {"model": cfg.architecture, "gpu": hw.name, "num_gpus": args.num_gpus,
           "nodes": nodes, "quantization": quant, "context": args.context, **p.to_dict()}
    if args.simulate:
        return _simulate(args, cfg, layout, roof[0], p, out)
    if args.json:
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return 0
    gb = 1e9
    lines = [f"{cfg.architecture} on {args.num_gpus} x {hw.name} ({nodes} node(s)), "
             f"experts {quant}, {args.context}-token requests",
             f"params: {p.total_params / 1e9:.1f}B total, {p.active_params / 1e9:.2f}B active",
             f"layout: TP{layout.tp} EP{layout.ep} PP{layout.pp} DP{layout.dp}, "
             f"{layout.moe_backend} ({layout.reason})",
             "bytes per GPU: " + ", ".join(f"{k} {v / gb:.1f} GB"
                                          for k, v in p.bytes_per_gpu.items()),
             f"fits: {'yes' if p.fits else 'NO'}; weights {p.weights_bytes_per_gpu / gb:.1f} GB "
             f"of {hw.memory_bytes / gb:.0f} GB per GPU",
             f"KDA state {p.kda_state_bytes_per_request / 1e6:.1f} MB per request, MLA "
             f"{p.mla_bytes_per_token / 1e3:.1f} kB per token (per GPU)",
             f"requests of {args.context} tokens that fit: {p.max_requests_at_context}; "
             f"longest single request: {p.max_context_single_request} tokens",
             f"prefill: {p.prefill_tok_s:.0f} tok/s (at {int(0.5 * 100)}% of peak FLOP/s)",
             f"decode: TPOT {p.decode_tpot_ms_batch1:.2f} ms at batch 1 "
             f"({1e3 / p.decode_tpot_ms_batch1:.0f} tok/s); batch "
             f"{p.decode_batch_memory_limited} (memory-limited): "
             f"{p.decode_tpot_ms_memory_limited:.2f} ms, "
             f"{p.decode_output_tok_s_memory_limited:.0f} tok/s"]
    if p.spec_decode_tok_s_batch1:
        lines.append(f"with speculation (acceptance {args.acceptance_length}): "
                     f"{p.spec_decode_tok_s_batch1:.0f} tok/s at batch 1")
    lines.append(f"cost: ${p.cost_per_hour:.2f}/h, ${p.cost_per_million_output_tokens:.3f} "
                 "per million output tokens at the memory-limited batch")
    if p.break_even_days is not None:
        lines.append(f"bought instead of the API at ${args.api_price}/M tokens: break-even "
                     f"after {p.break_even_days:.0f} days at that load")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _simulate(args, cfg, layout, roof, p, out: dict) -> int:
    from kdaserve.config import CacheConfig, SchedulerConfig
    from kdaserve.plan.simulate import host_tier, paper_cache, simulate
    from kdaserve.plan.step_cost import RooflineCost
    from kdaserve.plan.workload import from_trace, synthetic

    rate = 1.0 if args.arrival_rate is None else args.arrival_rate
    try:
        if args.trace:
            work = from_trace(args.trace, cfg.vocab_size, args.seed)
        else:
            work = synthetic(args.num_requests or 200, rate / layout.dp, args.prompt_len,
                             args.output_len, cfg.vocab_size, args.prefix_share, args.seed)
        longest = max(len(a.prompt_token_ids) + a.output_len for a in work) + 1
        cache_plan = paper_cache(p, roof, args.block_size, args.max_num_seqs, longest)
    except (ValueError, OSError, KeyError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    offload = host_tier(int(args.offload_bytes), cache_plan) if args.offload_bytes else None
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=longest)
    res = simulate(work, cache_plan, CacheConfig(block_size=args.block_size), sched,
                   RooflineCost(roof), offload)
    sim = res.to_dict()
    sim["deployment_output_throughput"] = sim["output_throughput"] * layout.dp
    out = {**out, "cache_plan": cache_plan.describe(), "simulation": sim}
    if args.json:
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return 0
    s = sim
    gb = 1e9
    lines = [
        f"{cfg.architecture} on {args.num_gpus} x {roof.hw.name}, TP{layout.tp} EP{layout.ep} "
        f"PP{layout.pp} DP{layout.dp}, experts {roof.quant}: simulated with the engine's "
        "scheduler, steps charged by the roofline",
        f"one dp replica's cache: {cache_plan.describe()}",
        f"workload (per replica): {len(work)} requests"
        + (f" from {args.trace}" if args.trace else
           f", {rate / layout.dp:g}/s, prompts {args.prompt_len}, outputs {args.output_len}, "
           f"prefix share {args.prefix_share:g}"),
        f"completed {s['completed']}, ended unfinished {s['ended_unfinished']}, in "
        f"{s['duration_s']:.1f} s simulated, {s['steps']} steps",
        f"TTFT ms: p50 {s['median_ttft_ms']:.1f}, p90 {s['p90_ttft_ms']:.1f}, "
        f"p99 {s['p99_ttft_ms']:.1f}",
        f"TPOT ms: p50 {s['median_tpot_ms']:.2f}, p90 {s['p90_tpot_ms']:.2f}, "
        f"p99 {s['p99_tpot_ms']:.2f}",
        f"output throughput: {s['output_throughput']:.1f} tok/s per replica, "
        f"{s['deployment_output_throughput']:.1f} tok/s for the deployment",
        f"prefix cache: {s['prefix_hit_rate']:.1%} of prompt tokens hit "
        f"({s['prefix_hits']} requests); snapshots taken {s['snapshots_taken']}, peak "
        f"{s['snapshot_bytes_peak'] / gb:.2f} GB",
        f"preemptions: {s['preemptions']}",
        "offload: " + (", ".join(
            f"{t} stored {s['offload_stored_bytes'].get(t, 0) / gb:.2f} GB, loaded "
            f"{s['offload_loaded_bytes'].get(t, 0) / gb:.2f} GB"
            for t in sorted(set(s["offload_stored_bytes"]) | set(s["offload_loaded_bytes"])))
            or ("none moved" if offload else "no tier (--offload-bytes)"))]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _calibrate(args) -> int:
    import math

    from kdaserve.plan.calibrate import CalibrationWorkload, calibrate

    w = CalibrationWorkload()
    over = {}
    if args.arrival_rate is not None:
        over["request_rate"] = args.arrival_rate
    if args.num_requests is not None:
        over["num_prompts"] = args.num_requests
    w = CalibrationWorkload(**{**w.__dict__, **over, "seed": args.seed})
    model = args.model if args.model and args.model not in PUBLISHED else None
    r = calibrate(w, model=model, clock="wall" if args.wall_clock else "cpu")
    if args.json:
        sys.stdout.write(json.dumps(r, indent=2) + "\n")
        return 0
    f, m, s = r["step_cost_fit"], r["measured"], r["simulated"]
    rate = "inf" if math.isinf(w.request_rate) else f"{w.request_rate:g}/s"
    rows = [("output tok/s", "output_throughput", 1), ("TTFT p50 ms", "median_ttft_ms", 1),
            ("TTFT p99 ms", "p99_ttft_ms", 1), ("TPOT p50 ms", "median_tpot_ms", 2),
            ("duration s", "duration_s", 2)]
    shown = os.path.relpath(r["model"])
    shown = r["model"] if shown.startswith("..") else shown
    lines = [f"calibration on this machine: {shown}, {r['clock']} clock",
             f"workload (kdaserve bench serve's): {w.num_prompts} requests, {rate}, input "
             f"{w.input_len} +-{w.range_ratio:.0%}, output {w.output_len} +-{w.range_ratio:.0%}",
             f"step cost fitted to {f['steps']} measured steps: decode alone "
             f"{f['decode_fixed_s'] * 1e3:.2f} ms + {f['per_decode_row_s'] * 1e3:.3f} ms/row; "
             f"with a prompt chunk {f['prompt_fixed_s'] * 1e3:.2f} ms + "
             f"{f['per_token_s'] * 1e3:.3f} ms/token + {f['per_prompt_chunk_s'] * 1e3:.3f} "
             f"ms/chunk (relative RMS error {f['relative_rms_error']:.0%})",
             f"{'':<14}{'measured':>10}{'simulated':>11}"]
    lines += [f"{name:<14}{m[k]:>10.{d}f}{s[k]:>11.{d}f}" for name, k, d in rows]
    lines += [f"simulated_vs_measured_throughput {r['simulated_vs_measured_throughput']:.3f}",
              f"simulated_vs_measured_ttft_p50 {r['simulated_vs_measured_ttft_p50']:.3f}"]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
