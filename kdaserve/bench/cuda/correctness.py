"""The `correctness` section: greedy tokens on the device against a CPU reference, for both
bundled models, with the KDA backend the registry picked and how often fla's kernel ran."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kdaserve.bench.cuda.driver import build_llm, free_memory, kda_backend
from kdaserve.bench.cuda.workload import MODELS, Sizes

PROMPTS = ("ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further",
           "The weather today is")


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@contextmanager
def _counting_fla_calls(device: torch.device) -> Iterator[list[int]]:
    """Counts the calls of fla's chunk_kda that the registry's CUDA ops make meanwhile (the
    registry binds the function when its ops are first built: they are rebuilt around it)."""
    calls = [0]
    if device.type != "cuda":
        yield calls
        return
    from kdaserve.ops import registry

    try:
        import fla.ops.kda as fla_kda  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - fla-core or triton missing: the registry uses torch
        yield calls
        return
    original = fla_kda.chunk_kda

    def counted(*a, **kw):
        calls[0] += 1
        return original(*a, **kw)

    fla_kda.chunk_kda = counted
    registry._cuda_ops.cache_clear()
    try:
        yield calls
    finally:
        fla_kda.chunk_kda = original
        registry._cuda_ops.cache_clear()


def _greedy(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from kdaserve.request import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for o in outs:
        if o.outputs[0].finish_reason == "error":
            raise RuntimeError(f"the engine failed a request: {o.outputs[0].stop_reason}")
    return [list(o.outputs[0].token_ids) for o in outs]


@contextmanager
def _cpu_reference(device: torch.device) -> Iterator[str]:
    """The CPU run the device's tokens are compared with. When the device is the CPU itself
    (`--tiny` runs, tests), the reference takes the torch forward instead of the fused decode
    blocks, so the comparison is between two code paths, not one run twice."""
    if device.type != "cpu":
        yield "cpu"
        return
    saved = os.environ.get("KDASERVE_FUSED_DECODE")
    os.environ["KDASERVE_FUSED_DECODE"] = "0"
    try:
        yield "cpu, torch forward (KDASERVE_FUSED_DECODE=0)"
    finally:
        if saved is None:
            del os.environ["KDASERVE_FUSED_DECODE"]
        else:
            os.environ["KDASERVE_FUSED_DECODE"] = saved


def correctness(device: torch.device, sizes: Sizes) -> dict:
    prompts = list(PROMPTS[:sizes.correctness_prompts])
    out: dict = {"prompts": len(prompts), "max_tokens": sizes.correctness_tokens,
                 "dtype": "float32", "kda_backend": kda_backend(device)}
    for name, path in MODELS.items():
        with _counting_fla_calls(device) as calls:
            llm = build_llm(path, device)
            dev_ids = _greedy(llm, prompts, sizes.correctness_tokens)
            backend = kda_backend(device)
        del llm
        free_memory(device)
        with _cpu_reference(device) as reference:
            cpu_llm = build_llm(path, torch.device("cpu"))
            cpu_ids = _greedy(cpu_llm, prompts, sizes.correctness_tokens)
            del cpu_llm
        out["cpu_reference"] = reference
        diffs = [(i, first_diff(a, b)) for i, (a, b) in enumerate(zip(dev_ids, cpu_ids))]
        diffs = [{"prompt": i, "first_diff_position": p} for i, p in diffs if p is not None]
        out[name] = {"greedy_identical_cuda_vs_cpu": not diffs, "first_diffs": diffs,
                     "tokens_per_prompt": [len(x) for x in dev_ids],
                     "kda_backend": backend, "fla_chunk_calls": calls[0]}
    return out
