"""The `spec` section: each demo's bundled DSpark draft against plain decode, batch 1,
greedy."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kdaserve.bench.cuda.driver import build_llm, error_row, free_memory
from kdaserve.bench.cuda.workload import MODELS, Sizes


def spec_one(path: Path, device: torch.device, sizes: Sizes) -> dict:
    from kdaserve.bench.spec_measure import measure
    from kdaserve.bench.spec_prompts import unseen_prompts
    from kdaserve.request import SamplingParams

    base = build_llm(path, device)
    spec = build_llm(path, device, speculative_method="dspark", num_speculative_tokens=sizes.spec_k)
    try:
        prompts = unseen_prompts()[:sizes.spec_prompts]
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for llm in (base, spec):
            llm.generate(prompts[:1], warm, use_tqdm=False)
        params = [SamplingParams(temperature=0.0, max_tokens=sizes.spec_tokens,
                                 ignore_eos=True)] * len(prompts)
        row = measure(base, spec, prompts, params, 1, greedy=True,
                      repeats=min(sizes.repeats, 2))
        if spec.engine.stats.failed or base.engine.stats.failed:
            raise RuntimeError("the engine failed requests (see the log)")
        return {"draft": f"{path.name}/draft", "k": sizes.spec_k,
                "max_tokens": sizes.spec_tokens, **row}
    finally:
        del base, spec
        free_memory(device)


def spec_decode(device: torch.device, sizes: Sizes, deadline: float) -> dict:
    out: dict = {"dtype": "float32", "batch": 1, "mode": "greedy"}
    for name in ("kimi_k3", "kimi_linear"):
        path = MODELS[name]
        if not (path / "draft" / "config.json").is_file():
            out[name] = {"skipped": "no bundled draft"}
        elif time.monotonic() > deadline:
            out[name] = {"skipped": "time budget spent"}
        else:
            try:
                out[name] = spec_one(path, device, sizes)
            except Exception as exc:  # noqa: BLE001 - reported, the others still run
                out[name] = error_row(exc)
    return out
