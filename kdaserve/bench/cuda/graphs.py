"""The `graphs` section: decode from captured CUDA graphs against `--enforce-eager`, per demo
model in the device's default dtype: greedy tokens identical (batch 1 and a small batch),
single-stream TPOT of each and their ratio, and what the capture cost (seconds, memory).

On a CPU (`--device cpu`, the tests) the graphs are the replay backend
(KDASERVE_DECODE_GRAPHS=replay, the torch forward): the same padding, buffers and in-graph
layout refresh, without a GPU."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
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
from kdaserve.bench.cuda.workload import MODELS, Sizes


@contextlib.contextmanager
def _cpu_replay(device: torch.device) -> Iterator[None]:
    keys = ("KDASERVE_DECODE_GRAPHS", "KDASERVE_FUSED_DECODE", "KDASERVE_DEVICE_RESIDENT")
    saved = {k: os.environ.get(k) for k in keys}
    if device.type != "cuda":
        os.environ.update(dict(zip(keys, ("replay", "0", "1"))))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from kdaserve.request import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _run(path: Path, device: torch.device, dtype: str, sizes: Sizes, eager: bool) -> dict:
    llm = build_llm(path, device, dtype, max_num_seqs=max(4, sizes.batch),
                    max_model_len=sizes.single_in + sizes.single_out + 64, enforce_eager=eager)
    try:
        graphs = llm.engine.runner.graphs
        vocab = llm.engine.model_config.vocab_size
        single = random_prompts(1, sizes.single_in, vocab, 11)
        few = random_prompts(3, sizes.batch_in, vocab, 12)
        tokens = _greedy(llm, single, sizes.single_out) + _greedy(llm, few, sizes.batch_out)
        drive(llm, single, 4)                                   # warm-up
        runs = [drive(llm, single, sizes.single_out) for _ in range(sizes.repeats)]
        tpot = median([median(r["steps"]) for r in runs if r["steps"]])
        row = {"tokens": tokens, "tpot_ms": round(tpot * 1e3, 3),
               "decode_tok_s": round(1 / tpot, 1)}
        if graphs is not None and graphs.report is not None:
            rep = graphs.report
            row["capture"] = {"sizes": rep.sizes, "seconds": round(rep.seconds, 2),
                              "mib": round(rep.bytes / 2**20, 1), "skipped": rep.skipped}
        return row
    finally:
        del llm
        free_memory(device)


def graphs_section(device: torch.device, sizes: Sizes) -> dict:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    out: dict = {"dtype": dtype, "backend": "cuda" if device.type == "cuda" else
                 "replay (CPU: KDASERVE_DECODE_GRAPHS=replay)"}
    with _cpu_replay(device):
        for name, path in MODELS.items():
            try:
                g = _run(path, device, dtype, sizes, eager=False)
                e = _run(path, device, dtype, sizes, eager=True)
            except Exception as exc:  # noqa: BLE001 - reported, the other model still runs
                out[name] = error_row(exc)
                continue
            out[name] = {
                "greedy_identical": g["tokens"] == e["tokens"],
                "graphs_tpot_ms": g["tpot_ms"], "eager_tpot_ms": e["tpot_ms"],
                "graphs_decode_tok_s": g["decode_tok_s"], "eager_decode_tok_s": e["decode_tok_s"],
                "graphs_vs_eager": round(e["tpot_ms"] / g["tpot_ms"], 3),
                "capture": g.get("capture"),
            }
    return out
