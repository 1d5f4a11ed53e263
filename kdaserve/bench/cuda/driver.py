"""Building and driving engines for the bench sections: the engine is stepped by hand so
each step can be timed, and a failed request raises instead of being timed."""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def build_llm(model: Path | str, device: torch.device, dtype: str = "float32", **kw):
    from kdaserve.engine.llm import LLM

    kw.setdefault("enable_prefix_caching", False)   # repeats must compute their prompts
    return LLM(str(model), device=str(device), dtype=dtype, **kw)


def kda_backend(device: torch.device) -> str:
    from kdaserve.ops.registry import kda_ops

    return kda_ops(device).name


def drive(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Runs the prompts as concurrent greedy requests, step by step: wall time, time to the
    first token, step times after it (decode), tokens. A request the engine failed raises."""
    from kdaserve.request import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    base = f"b{time.monotonic_ns()}-"
    for i, p in enumerate(prompts):
        eng.add_request(f"{base}{i}", p, params)
    steps: list[float] = []
    first = None
    tokens = 0
    start = time.perf_counter()
    while eng.has_unfinished():
        t0 = time.perf_counter()
        deltas = eng.step()
        t1 = time.perf_counter()
        new = 0
        for d in deltas:
            if d.finish_reason == "error":
                raise RuntimeError(f"the engine failed a request: {d.error}")
            new += len(d.new_token_ids)
        if new and first is None:
            first = t1 - start
        elif new:
            steps.append(t1 - t0)
        tokens += new
    total = time.perf_counter() - start
    return {"seconds": total, "ttft": first or total, "steps": steps, "tokens": tokens}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, length), generator=g).tolist()


def error_row(exc: BaseException) -> dict:
    """A failed section, model or context as a row: the run goes on with the others."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": "".join(tb)[-3000:]}
