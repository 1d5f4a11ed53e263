"""The `long` section: the random hybrid of `kdaserve bench long` at growing contexts on the
device: prefill rate, decode TPOT after it, and how TPOT grows."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from kdaserve.bench.cuda.driver import (
    build_llm,
    drive,
    error_row,
    free_memory,
    median,
    random_prompts,
)
from kdaserve.bench.cuda.workload import Sizes


def long_one(model_dir: Path, context: int, device: torch.device, sizes: Sizes) -> dict:
    """One request reaching `context` tokens (prompt, then long_decode greedy tokens), as
    kdaserve.bench.long.measure does on the CPU, on `device`."""
    from kdaserve.cache.spec import specs_for
    from kdaserve.model.registry import load_config

    decode = sizes.long_decode
    latent, state = specs_for(load_config(str(model_dir)), 16, "float32")
    memory = (context + 16) * latent.bytes_per_token + state.bytes_per_slot + (1 << 20)
    llm = build_llm(model_dir, device, max_model_len=context, cache_memory=memory,
               max_num_batched_tokens=sizes.long_chunk, max_num_seqs=1)
    try:
        vocab = llm.engine.model_config.vocab_size
        prompt = random_prompts(1, context - decode, vocab, 0)[0]
        drive(llm, [prompt[:256]], 2)                                  # warm-up
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        r = drive(llm, [prompt], decode)
        n = len(prompt)
        row = {"context": context, "prompt_tokens": n, "completed": r["tokens"] == decode,
               "prefill_s": round(r["ttft"], 3), "prefill_tok_s": round(n / r["ttft"], 1),
               "tpot_ms": round(median(r["steps"]) * 1e3, 3) if r["steps"] else None,
               "cache_bytes": llm.engine.plan.request_bytes(context)}
        if device.type == "cuda":
            row["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        return row
    finally:
        del llm
        free_memory(device)


def long_context(device: torch.device, sizes: Sizes, deadline: float) -> dict:
    from kdaserve.bench.long_model import make_model_dir

    rows = []
    with tempfile.TemporaryDirectory(prefix="kdaserve-bench-cuda-") as tmp:
        model_dir = make_model_dir(Path(tmp), None, all_mla=False)
        for c in sizes.long_contexts:
            if time.monotonic() > deadline:
                rows.append({"context": c, "skipped": "time budget spent"})
                continue
            try:
                rows.append(long_one(model_dir, c, device, sizes))
            except Exception as exc:  # noqa: BLE001 - reported, the others still run
                rows.append({"context": c, **error_row(exc)})
    tpot = {r["context"]: r.get("tpot_ms") for r in rows}
    lo, hi = sizes.long_contexts[0], sizes.long_contexts[-1]
    ratio = (round(tpot[hi] / tpot[lo], 3) if tpot.get(hi) and tpot.get(lo) else None)
    return {"model": "bench tiny hybrid (kdaserve.bench.long_model.bench_config), fp32",
            "decode_tokens": sizes.long_decode, "max_num_batched_tokens": sizes.long_chunk,
            f"tpot_ratio_{_k(hi)}_{_k(lo)}": ratio, "runs": rows}


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
