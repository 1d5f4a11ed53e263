"""The `throughput` section: single-stream decode, a batch, and one prefill, per model and
dtype."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kdaserve.bench.cuda.driver import (
    build_llm,
    drive,
    error_row,
    free_memory,
    kda_backend,
    median,
    random_prompts,
)
from kdaserve.bench.cuda.workload import MODELS, Sizes


def throughput_one(path: Path, device: torch.device, dtype: str, sizes: Sizes,
                   threads: int | None = None) -> dict:
    llm = build_llm(path, device, dtype, max_num_seqs=max(sizes.batch, sizes.batch64, 1),
               max_num_batched_tokens=max(4096, sizes.prefill),
               max_model_len=max(4096, sizes.prefill + 64), num_threads=threads)
    try:
        vocab = llm.engine.model_config.vocab_size
        single = random_prompts(1, sizes.single_in, vocab, 1)
        batch = random_prompts(sizes.batch, sizes.batch_in, vocab, 2)
        wide = random_prompts(sizes.batch64, sizes.batch_in, vocab, 4)
        prefill = random_prompts(1, sizes.prefill, vocab, 3)
        for p, n in ((single, 4), (batch, 2), (wide, 2), (prefill, 1)):   # warm-up
            drive(llm, p, n)
        r = sizes.repeats
        s_runs = [drive(llm, single, sizes.single_out) for _ in range(r)]
        b_runs = [drive(llm, batch, sizes.batch_out) for _ in range(r)]
        w_runs = [drive(llm, wide, sizes.batch_out) for _ in range(r)]
        p_runs = [drive(llm, prefill, 1) for _ in range(r)]
        s_tpot = median([median(x["steps"]) for x in s_runs if x["steps"]] or [float("nan")])
        b_tpot = median([median(x["steps"]) for x in b_runs if x["steps"]] or [float("nan")])
        return {
            "kda_backend": kda_backend(device),
            "single_tpot_ms": round(s_tpot * 1e3, 3),
            "single_decode_tok_s": round(1 / s_tpot, 1),
            "single_output_tok_s": round(median([x["tokens"] / x["seconds"] for x in s_runs]), 1),
            "batch32_output_tok_s": round(median([x["tokens"] / x["seconds"]
                                                   for x in b_runs]), 1),
            "batch32_step_ms": round(b_tpot * 1e3, 3),
            "batch32_decode_tok_s": round(sizes.batch / b_tpot, 1),
            "batch64_output_tok_s": round(median([x["tokens"] / x["seconds"]
                                                   for x in w_runs]), 1),
            "prefill_ms": round(median([x["ttft"] for x in p_runs]) * 1e3, 2),
            "prefill_tok_s": round(median([sizes.prefill / x["ttft"] for x in p_runs]), 1),
        }
    finally:
        del llm
        free_memory(device)


def throughput(device: torch.device, sizes: Sizes, deadline: float,
               threads: int | None = None) -> dict:
    out: dict = {"single": f"{sizes.single_in} in / {sizes.single_out} out",
                 "batch32": f"{sizes.batch} x {sizes.batch_in} in / {sizes.batch_out} out",
                 "prefill_tokens": sizes.prefill, "repeats": sizes.repeats}
    for name in ("kimi_linear", "kimi_k3"):
        for dtype in ("float32", "bfloat16"):
            key = f"{name}_{'fp32' if dtype == 'float32' else 'bf16'}"
            if time.monotonic() > deadline:
                out[key] = {"skipped": "time budget spent"}
                continue
            try:
                out[key] = throughput_one(MODELS[name], device, dtype, sizes, threads)
            except Exception as exc:  # noqa: BLE001 - reported, the others still run
                out[key] = error_row(exc)
    return out
