"""`kdaserve plan --model DIR|config.json --gpu H200 --num-gpus 8 [...]`: prints the plan
(kdaserve/plan/model.py) as a table, or as JSON with --json."""

from __future__ import annotations

import argparse
import json
import sys

from kdaserve.plan.model import EXPERT_BITS, Layout, plan, recommend


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or config.json")
    p.add_argument("--gpu", required=True, help="an entry of the hardware table "
                   "(kdaserve/plan/hardware.json: H100, H200, B200, GB300, MI300X, MI355X, "
                   "RTX5090, EPYC-2C)")
    p.add_argument("--hardware", default=None, metavar="FILE",
                   help="a JSON table of more (or changed) entries, same keys")
    p.add_argument("--num-gpus", type=int, required=True, help="GPUs in all")
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


def run(args: argparse.Namespace) -> int:
    from kdaserve.model.registry import load_config
    from kdaserve.plan.hardware import find, load_table

    cfg = load_config(args.model)
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
    p = plan(cfg, hw, layout, quant, args.context, memory_util=args.gpu_memory_utilization,
             acceptance_length=args.acceptance_length, api_price=args.api_price)
    out = {"model": cfg.architecture, "gpu": hw.name, "num_gpus": args.num_gpus,
           "nodes": nodes, "quantization": quant, "context": args.context, **p.to_dict()}
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
