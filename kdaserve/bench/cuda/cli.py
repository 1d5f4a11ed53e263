"""`kdaserve bench cuda`'s command line and the run: the sections in order, each saved as it
ends, and the headline summary drawn from them."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from kdaserve.bench.cuda.correctness import correctness
from kdaserve.bench.cuda.driver import error_row
from kdaserve.bench.cuda.graphs import graphs_section
from kdaserve.bench.cuda.kda_op import kda_op
from kdaserve.bench.cuda.long_context import long_context
from kdaserve.bench.cuda.shapes_48b import shapes_48b
from kdaserve.bench.cuda.spec_decode import spec_decode
from kdaserve.bench.cuda.throughput import throughput
from kdaserve.bench.cuda.workload import MODELS, TINY, Sizes

SECTIONS = ("correctness", "kda_op", "throughput", "graphs", "long", "spec", "shapes48b")


def _environment(device: torch.device) -> dict:
    env = {"device": str(device), "torch": torch.__version__,
           "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    for mod in ("triton", "fla"):
        try:
            env[mod] = importlib.import_module(mod).__version__
        except Exception as exc:  # noqa: BLE001
            env[mod] = f"unavailable ({type(exc).__name__})"
    return env


def summarize(result: dict) -> dict:
    """The headline keys, from the sections."""
    s: dict = {}
    corr = result.get("correctness", {})
    for name in MODELS:
        if isinstance(corr.get(name), dict):
            s[f"{name}_greedy_identical_cuda_vs_cpu"] = corr[name]["greedy_identical_cuda_vs_cpu"]
    if "kda_backend" in corr:
        s["kda_backend"] = corr["kda_backend"]
    op = result.get("kda_op", {})
    if "fla_chunk_vs_torch_ref_max_abs_err_o" in op:
        s["fla_chunk_vs_torch_ref_max_abs_err"] = max(
            op["fla_chunk_vs_torch_ref_max_abs_err_o"],
            op["fla_chunk_vs_torch_ref_max_abs_err_state"])
    long_ = result.get("long", {})
    for k, v in long_.items():
        if k.startswith("tpot_ratio_"):
            s[k] = v
    for name in MODELS:
        row = result.get("spec", {}).get(name, {})
        if "speedup" in row:
            s[f"{name}_spec_speedup_batch1"] = row["speedup"]
    tp = result.get("throughput", {})
    for key in ("kimi_linear_bf16", "kimi_linear_fp32"):      # bf16: CUDA's default
        if "single_decode_tok_s" in tp.get(key, {}):
            s["kimi_linear_single_decode_tok_s"] = tp[key]["single_decode_tok_s"]
            s["kimi_linear_batch64_output_tok_s"] = tp[key].get("batch64_output_tok_s")
            break
    shapes = result.get("shapes48b", {})
    if "decode" in shapes:
        s["hbm_utilization_batch1"] = shapes["hbm_utilization_batch1"]
        s["shapes48b_tpot_batch1_ms"] = shapes["decode"]["batch1"]["tpot_ms"]
        s["shapes48b_roofline_tpot_batch1_ms"] = shapes["decode"]["batch1"]["roofline_tpot_ms"]
        s["shapes48b_graphs_vs_eager"] = shapes.get("graphs_vs_eager")
    graphs = result.get("graphs", {})
    rows = [graphs[m] for m in MODELS if isinstance(graphs.get(m), dict)
            and "greedy_identical" in graphs[m]]
    if rows:
        s["greedy_identical_graphs_vs_eager"] = all(r["greedy_identical"] for r in rows)
    if "graphs_vs_eager" in graphs.get("kimi_linear", {}):
        s["graphs_vs_eager"] = graphs["kimi_linear"]["graphs_vs_eager"]
    if "gpu" in result.get("environment", {}):
        s["device_name"] = result["environment"]["gpu"]
    return s


def run_sections(device: torch.device, sizes: Sizes, sections: tuple[str, ...],
                 budget_s: float, out_path: str | None = None,
                 threads: int | None = None) -> dict:
    start = time.monotonic()
    deadline = start + budget_s
    result: dict = {"summary": {}, "environment": _environment(device), "sizes": asdict(sizes)}

    def save() -> None:
        if out_path:
            Path(out_path).write_text(json.dumps(result) + "\n", encoding="utf-8")

    jobs: dict[str, Callable[[], dict]] = {
        "correctness": lambda: correctness(device, sizes),
        "kda_op": lambda: kda_op(device, sizes),
        "throughput": lambda: throughput(device, sizes, deadline, threads),
        "graphs": lambda: graphs_section(device, sizes),
        "long": lambda: long_context(device, sizes, deadline),
        "spec": lambda: spec_decode(device, sizes, deadline),
        "shapes48b": lambda: shapes_48b(device, sizes, tiny=sizes == TINY),
    }
    for name in SECTIONS:
        if name not in sections:
            continue
        if time.monotonic() > deadline:
            result[name] = {"skipped": "time budget spent"}
            continue
        t0 = time.monotonic()
        print(f"... {name}", file=sys.stderr, flush=True)
        try:
            result[name] = jobs[name]()
        except Exception as exc:  # noqa: BLE001 - reported, the next section still runs
            result[name] = error_row(exc)
        result[name]["section_s"] = round(time.monotonic() - t0, 1)
        result["summary"] = summarize(result)
        save()
    result["summary"] = summarize(result)
    result["wall_s"] = round(time.monotonic() - start, 1)
    save()
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="the device measured (default: cuda when available, else cpu)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--tiny", action="store_true",
                   help="a few tokens everywhere: exercises the code paths (CPU tests)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure (median)")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="sections (and models, contexts) not started by then are skipped")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the JSON there, rewritten after each section")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads of the CPU side (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object only")


def run(args: argparse.Namespace) -> int:
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    logging.getLogger("kdaserve").setLevel(logging.WARNING)
    sizes = TINY if args.tiny else Sizes()
    if args.repeats:
        sizes = replace(sizes, repeats=args.repeats)
    result = run_sections(torch.device(args.device), sizes, tuple(args.sections),
                          args.budget_s, args.out, args.torch_threads)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
