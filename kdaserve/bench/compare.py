"""`kdaserve bench compare`: the same workloads through kdaserve and llama.cpp on the same
checkpoint, interleaved (kdaserve, then llama.cpp, workload by workload), best of N.

Workloads: one stream (128-token prompt, 256 greedy tokens), 32 requests at once (128 in /
128 out, continuous batching on both sides), prefill of one 2,048-token prompt. Prompts are
token ids (both engines read the same ids; tokenizers play no part), generation is greedy
with EOS ignored, prefix caching is off so repeats recompute.

The peer is llama-cpp-python in its own virtualenv (kdaserve/bench/peers/setup_llamacpp.sh
builds it and the GGUF; docs/benchmarks.md has the steps). The bench uses it when it finds
<peers-dir>/llamacpp-venv and the converted model, builds both when asked with
--setup-peers, and otherwise prints kdaserve's figures alone with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from kdaserve.assets import kimi_linear_demo_path
from kdaserve.bench import memory_bound
from kdaserve.bench.llamacpp import (
    DEFAULT_PEERS,
    LlamaCppPeer,
    find_peer,
    gguf_kind,
    setup_peers,
)
from kdaserve.config import SchedulerConfig
from kdaserve.engine.llm import LLM
from kdaserve.ops.cpu_isa import cpu_isa
from kdaserve.outputs import RequestOutput
from kdaserve.request import SamplingParams


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, length), generator=g).tolist()


class KdaservePeer:
    """kdaserve's side, in this process."""

    def __init__(self, model: str, dtype: str, threads: int, max_seqs: int,
                 speculative: str | None = None, quantization: str | None = None) -> None:
        torch.set_num_threads(threads)
        self.llm = LLM(model, dtype=dtype, max_num_seqs=max_seqs, max_model_len=4096,
                       max_num_batched_tokens=2048, enable_prefix_caching=False,
                       speculative_method=speculative, quantization=quantization)
        self.sampling: dict = {}          # empty: greedy; else temperature, top_p, seed

    def _gen(self, prompts: list[list[int]], out: int
             ) -> tuple[float, float, list[RequestOutput]]:
        sp = SamplingParams(**{"temperature": 0.0, **self.sampling}, max_tokens=out,
                            ignore_eos=True)
        c0, t0 = time.process_time(), time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                 use_tqdm=False)
        return time.perf_counter() - t0, time.process_time() - c0, outs

    def single(self, prompt: list[int], out: int) -> dict:
        s, cpu, outs = self._gen([prompt], out)
        m = outs[0].metrics          # the first token ends the prefill, as the peer's does
        return {"seconds": s, "cpu_seconds": cpu, "tokens": outs[0].outputs[0].token_ids,
                "prefill_seconds": m.first_token_time - m.arrival_time,
                "decode_seconds": m.last_token_time - m.first_token_time}

    def batch(self, prompts: list[list[int]], out: int) -> dict:
        s, cpu, outs = self._gen(prompts, out)
        toks = [o.outputs[0].token_ids for o in outs]
        return {"seconds": s, "cpu_seconds": cpu, "output_tokens": sum(map(len, toks)),
                "tokens": toks}

    def prefill(self, prompt: list[int]) -> dict:
        s, cpu, _ = self._gen([prompt], 1)
        return {"seconds": s, "cpu_seconds": cpu}


def _best(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: r["seconds"])


def _agreement(a: list[int], b: list[int]) -> dict:
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"identical": a == b, "matching_prefix": same, "length": len(a)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model directory (default: the bundled Kimi Linear demo, "
                        "which llama.cpp converts)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--peers-dir", default=str(DEFAULT_PEERS),
                   help="where the llama.cpp virtualenv and GGUF files live")
    p.add_argument("--setup-peers", action="store_true",
                   help="build the llama.cpp peer and convert the model first (minutes)")
    p.add_argument("--threads", type=int, default=2, help="threads for each engine")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--single-input", type=int, default=128)
    p.add_argument("--single-output", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batch-input", type=int, default=128)
    p.add_argument("--batch-output", type=int, default=128)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--workloads", default="single,batch,prefill")
    p.add_argument("--speculative", choices=("dspark", "ngram"), default=None,
                   help="also run kdaserve's single stream with speculation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: sampled decoding on both sides (top-p --top-p; llama.cpp through "
                        "its own sampler chain), speed only; 0: greedy, outputs compared")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--shape", default="demo", choices=("demo", "memory-bound"),
                   help="memory-bound: a random model of the demo's family whose active weights "
                        "per token are >= 8x this CPU's last-level cache (built once under "
                        "--peers-dir, with its GGUFs); its runs are bf16, or --quantization")
    p.add_argument("--quantization", default=None, choices=("int8", "int4"),
                   help="kdaserve quantizes on load, against llama.cpp's Q8_0 / Q4_0 of the "
                        "same weights")
    p.add_argument("--isa", default="native", choices=("native", "avx2", "avx512", "all"),
                   help="the CPU kernels' variant (KDASERVE_CPU_ISA); all: every variant this "
                        "machine executes, one process each, side by side")


def _each_variant(args: argparse.Namespace) -> int:
    """`--isa all`: the same bench once per variant this CPU runs, each in its own process
    (a process builds its kernels once), reported side by side."""
    from kdaserve.ops.cpu_isa import native_isa, runnable_variants

    flags = ["--dtype", args.dtype, "--peers-dir", args.peers_dir, "--threads",
             str(args.threads), "--repeats", str(args.repeats), "--single-input",
             str(args.single_input), "--single-output", str(args.single_output), "--batch",
             str(args.batch), "--batch-input", str(args.batch_input), "--batch-output",
             str(args.batch_output), "--prefill", str(args.prefill), "--workloads",
             args.workloads, "--seed", str(args.seed), "--shape", args.shape,
             "--temperature", str(args.temperature), "--top-p", str(args.top_p), "--json"]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    if args.model:
        flags += ["--model", args.model]
    if args.speculative:
        flags += ["--speculative", args.speculative]
    report: dict = {"cpu_isa": "all", "native": native_isa(), "variants": {}}
    for variant in runnable_variants() or ["native"]:
        done = subprocess.run([sys.executable, "-m", "kdaserve.cli", "bench", "compare",
                               "--isa", variant, *flags], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            report["variants"][variant] = {"error": done.stderr[-2000:]}
            continue
        report["variants"][variant] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.isa == "all":
        return _each_variant(args)
    if args.isa != "native":       # before any kernel is built in this process
        os.environ["KDASERVE_CPU_ISA"] = args.isa
    peers = Path(args.peers_dir)
    extra: dict = {}
    if args.shape == "memory-bound":
        model, kind = memory_bound.setup(args, peers, extra)
    else:
        model = args.model or str(kimi_linear_demo_path())
        kind = gguf_kind(args.quantization, args.dtype)
        if args.setup_peers:
            setup_peers(peers, model, args.dtype)
            if args.quantization:       # llama.cpp's Q8_0 / Q4_0 of the same checkpoint
                memory_bound.ensure_gguf(peers, Path(model), args.quantization)
    found = find_peer(peers, model, kind)
    from kdaserve.model.registry import load_config

    vocab = load_config(model).vocab_size        # also a kimi_k3 layout (under text_config)
    single_prompt = _prompts(1, args.single_input, vocab, args.seed)[0]
    batch_prompts = _prompts(args.batch, args.batch_input, vocab, args.seed + 1)
    prefill_prompt = _prompts(1, args.prefill, vocab, args.seed + 2)[0]
    work = [w.strip() for w in args.workloads.split(",") if w.strip()]

    kd = KdaservePeer(model, args.dtype, args.threads, max(args.batch, 1),
                      quantization=args.quantization)
    spec = (KdaservePeer(model, args.dtype, args.threads, 4, args.speculative)
            if args.speculative else None)
    lc = lc_batch = None
    if isinstance(found, tuple):
        python, gguf = found
        lc = LlamaCppPeer(python, gguf, args.threads, 1,
                          max(args.prefill, args.single_input + args.single_output) + 16)
        if "batch" in work:
            lc_batch = LlamaCppPeer(python, gguf, args.threads, args.batch,
                                    args.batch_input + args.batch_output + 16)
    if args.temperature > 0:
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
        kd.sampling = sampling
        for peer in (lc, lc_batch):
            if peer is not None:
                peer.ask(op="sampling", **sampling)
        extra["sampling"] = sampling
    runs: dict[str, dict[str, list]] = {w: {"kdaserve": [], "llamacpp": []} for w in work}
    if spec is not None:
        runs["single_spec"] = {"kdaserve": []}
    single = kd.single
    if args.shape == "memory-bound":
        single = memory_bound.beside_read_rate(kd.single, args.threads)
    for _ in range(args.repeats):
        for w in work:
            if w == "single":
                runs[w]["kdaserve"].append(single(single_prompt, args.single_output))
                if lc is not None:
                    runs[w]["llamacpp"].append(lc.ask(op="single", prompt=single_prompt,
                                                      out=args.single_output))
                if spec is not None:
                    runs["single_spec"]["kdaserve"].append(
                        spec.single(single_prompt, args.single_output))
            elif w == "batch":
                runs[w]["kdaserve"].append(kd.batch(batch_prompts, args.batch_output))
                if lc_batch is not None:
                    runs[w]["llamacpp"].append(lc_batch.ask(op="batch", prompts=batch_prompts,
                                                            out=args.batch_output))
            elif w == "prefill":
                runs[w]["kdaserve"].append(kd.prefill(prefill_prompt))
                if lc is not None:
                    runs[w]["llamacpp"].append(lc.ask(op="prefill", prompt=prefill_prompt))
    report = summarize(runs, args, found, lc)
    report.update(extra)
    if args.shape == "memory-bound" and "kdaserve_single_tok_s" in report:
        report.update(memory_bound.decode_report(kd.llm.engine.model, runs["single"],
                                                 args.single_output, args.threads))
    for p in (lc, lc_batch):
        if p is not None:
            p.close()
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def summarize(runs: dict, args: argparse.Namespace, found, lc) -> dict:
    rate = {
        "single": lambda r: args.single_output / r["seconds"],
        "single_spec": lambda r: args.single_output / r["seconds"],
        "batch": lambda r: r["output_tokens"] / r["seconds"],
        "prefill": lambda r: args.prefill / r["seconds"],
    }
    report: dict = {"dtype": args.dtype, "cpu_isa": cpu_isa(), "threads": args.threads,
                    "repeats": args.repeats,
                    # kdaserve's multi-step decoding (engine/decode_burst.py): the default
                    "num_scheduler_steps": SchedulerConfig().num_scheduler_steps,
                    "llamacpp": lc.info if lc is not None else None,
                    "peer_missing": found if isinstance(found, str) else None,
                    "load_average": os.getloadavg()}
    for w, sides in runs.items():
        for side, rs in sides.items():
            if not rs:
                continue
            best = _best(rs)
            report[f"{side}_{w}_tok_s"] = round(rate[w](best), 1)
            if "cpu_seconds" in best:
                report[f"{side}_{w}_cpu_seconds"] = round(best["cpu_seconds"], 3)
        if sides.get("llamacpp"):
            kb, lb = _best(sides["kdaserve"]), _best(sides["llamacpp"])
            report[f"ratio_vs_llamacpp_{w}"] = round(rate[w](kb) / rate[w](lb), 3)
            if args.temperature > 0:
                continue                 # sampled: the speeds only
            if w == "single":
                report["greedy_agreement_single"] = _agreement(kb["tokens"], lb["tokens"])
            if w == "batch":
                agree = [_agreement(a, b) for a, b in zip(kb["tokens"], lb["tokens"])]
                report["greedy_agreement_batch"] = {
                    "identical_sequences": sum(a["identical"] for a in agree),
                    "sequences": len(agree),
                    "min_matching_prefix": min(a["matching_prefix"] for a in agree)}
    if "single_spec" in runs and runs.get("single", {}).get("llamacpp"):
        sb, lb = _best(runs["single_spec"]["kdaserve"]), _best(runs["single"]["llamacpp"])
        report["ratio_spec_vs_llamacpp_single"] = round(lb["seconds"] / sb["seconds"], 3)
        report["greedy_agreement_spec"] = _agreement(
            sb["tokens"], _best(runs["single"]["kdaserve"])["tokens"])
    return report
