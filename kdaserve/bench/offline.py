"""`kdaserve bench offline`: offline throughput, kdaserve vs transformers generate() on the same
weights, measured side by side in one run (ratios, not absolute numbers, are the claim)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from kdaserve.assets import kimi_linear_demo_path
from kdaserve.engine.llm import LLM
from kdaserve.ops.cpu_isa import cpu_isa
from kdaserve.request import SamplingParams


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, length), generator=g).tolist()


def _best(runs: list[dict]) -> dict:
    """The fastest of several runs (noise on a shared machine only ever slows a run down)."""
    return min(runs, key=lambda r: r["seconds"])


def _counted(name: str, best: dict) -> dict:
    """What a rate was computed from, so a reader (and the tests) can check it."""
    return {f"{name}_output_tokens": best["output_tokens"],
            f"{name}_seconds": round(best["seconds"], 6)}


def run_kdaserve(llm: LLM, prompts: list[list[int]], out_len: int) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def load_hf(model_dir: str):
    from transformers import KimiLinearForCausalLM

    hf = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=2, do_sample=False)
    return hf


@torch.no_grad()
def run_hf(hf, prompts: list[list[int]], out_len: int, batch: int) -> dict:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    tokens = []
    for i in range(0, len(prompts), batch):
        # plain greedy: override the model's generation_config sampling defaults
        out = hf.generate(ids[i:i + batch], attention_mask=torch.ones_like(ids[i:i + batch]),
                          max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False,
                          repetition_penalty=1.0, top_p=None, temperature=None,
                          eos_token_id=None, pad_token_id=0)
        tokens.extend(out[:, ids.shape[1]:].tolist())
    elapsed = time.perf_counter() - start
    n_out = sum(len(t) for t in tokens)
    return {"seconds": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed,
            "tokens": tokens}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model directory (default: the Kimi Linear demo, which transformers runs)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--single-output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each workload per engine; the fastest counts")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object only")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    model = str(args.model or kimi_linear_demo_path())
    # no prefix caching: repeated runs (and the single stream, which reuses a batch prompt)
    # must compute their prompts as transformers does
    llm = LLM(model, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=max(2048, args.input_len * 4), enable_prefix_caching=False)
    vocab = llm.engine.model.config.vocab_size
    prompts = _prompts(args.num_prompts, args.input_len, vocab, args.seed)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)  # warm-up
    hf = None if args.no_hf else load_hf(model)
    # The engines take turns, repeat by repeat, so a slow phase of the machine hits both.
    runs: dict[str, list[dict]] = {"batch": [], "single": [], "hf_batch": [], "hf_single": []}
    for _ in range(args.repeats):
        runs["batch"].append(run_kdaserve(llm, prompts, args.output_len))
        if hf is not None:
            runs["hf_batch"].append(run_hf(hf, prompts, args.output_len, args.max_num_seqs))
    for _ in range(args.repeats):
        runs["single"].append(run_kdaserve(llm, prompts[:1], args.single_output_len))
        if hf is not None:
            runs["hf_single"].append(run_hf(hf, prompts[:1], args.single_output_len, 1))
    batch, single = _best(runs["batch"]), _best(runs["single"])
    result = {
        "model": model, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "cpu_isa": cpu_isa(), "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "batch_tok_s": round(batch["output_tok_s"], 1),
        "single_tok_s": round(single["output_tok_s"], 1),
        **_counted("batch", batch), **_counted("single", single),
    }
    if hf is not None:
        hf_batch, hf_single = _best(runs["hf_batch"]), _best(runs["hf_single"])
        result.update({
            "hf_batch_tok_s": round(hf_batch["output_tok_s"], 1),
            "hf_single_tok_s": round(hf_single["output_tok_s"], 1),
            **_counted("hf_batch", hf_batch), **_counted("hf_single", hf_single),
            "batch_ratio_vs_hf": round(batch["output_tok_s"] / hf_batch["output_tok_s"], 2),
            "single_ratio_vs_hf": round(single["output_tok_s"] / hf_single["output_tok_s"], 2),
            "batch_identical_to_hf": all(r["tokens"] == hf_batch["tokens"]
                                         for r in runs["batch"]),
            "single_identical_to_hf": all(r["tokens"] == hf_single["tokens"]
                                          for r in runs["single"]),
        })
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
