"""`kdaserve bench cuda`: kdaserve's CUDA path checked and timed on one GPU, in one run.

Sections (each its own key; one that fails records its error and the run goes on):

- `correctness`: for both bundled models (the K3 demo, the Kimi Linear demo) a few text prompts
  generated greedily together, fp32, on the device and on the CPU (`cpu_reference`; with
  `--device cpu` the CPU run takes the torch forward): `greedy_identical_cuda_vs_cpu`
  and, where they differ, the first differing position per prompt (fp32 reductions differ
  between devices, so this is reported, not asserted); which KDA backend the registry picked on
  the device and how many times fla's Triton chunk kernel ran in the device generation.
- `kda_op`: fla-core's chunk_kda (what the registry calls on CUDA) against kdaserve's torch
  reference `kdaserve.ops.kda.kda_chunk` and fla's naive recurrence on random inputs of the
  demos' KDA shape (max abs error of outputs and final states), and both chunked forms timed on
  one long prefill.
- `throughput`: per model and dtype (fp32, bf16): single-stream decode (128-token prompt, 256
  greedy tokens: TPOT median, decode tok/s), batch 32 (32 requests x 128 in / 128 out: output
  tok/s end to end, and decode tok/s from the median step), prefill tok/s of one 2,048-token
  prompt (one engine step).
- `long`: the random hybrid of `kdaserve bench long` (kdaserve/bench/long.py) at 1k, 16k and
  128k tokens of context: prefill tok/s (chunked, 8,192-token steps), decode TPOT after it, and
  `tpot_ratio_128k_1k`.
- `spec`: speculative decoding with each demo's bundled DSpark draft, batch 1, greedy, against
  plain decode (`kdaserve.bench.spec.measure`: speedup, acceptance, identical outputs).

Timings: warm-ups first (Triton compiles and autotunes per shape), every engine step ends in a
device-to-host copy of the logits (a synchronisation), explicit torch.cuda.synchronize around
op timings, medians of `--repeats` runs. On a fresh machine Triton compiles and autotunes
fla's kernels on first use, per head size: about two of the six minutes of a cold run on an
H200 (docs/benchmarks.md); about three minutes once its cache is warm. `--budget-s` bounds the
run: a section, model or context not started when it is spent is skipped (and says so).
`--tiny` shrinks every size to a few tokens, so the whole bench runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kdaserve.assets import DEMO_MODEL_DIR, KIMI_LINEAR_DEMO_DIR

MODELS = {"kimi_k3": DEMO_MODEL_DIR, "kimi_linear": KIMI_LINEAR_DEMO_DIR}
SECTIONS = ("correctness", "kda_op", "throughput", "long", "spec")
PROMPTS = ("ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further",
           "The weather today is")


@dataclass(frozen=True)
class Sizes:
    correctness_prompts: int = 3
    correctness_tokens: int = 64
    kda_check: tuple[int, int, int, int] = (2, 512, 4, 64)      # B, T, H, D
    kda_time_len: int = 8192
    single_in: int = 128
    single_out: int = 256
    batch: int = 32
    batch_in: int = 128
    batch_out: int = 128
    prefill: int = 2048
    spec_prompts: int = 2
    spec_tokens: int = 128
    spec_k: int = 7
    long_contexts: tuple[int, ...] = (1024, 16384, 131072)
    long_decode: int = 32
    long_chunk: int = 8192
    repeats: int = 3


TINY = Sizes(correctness_prompts=2, correctness_tokens=4, kda_check=(1, 40, 2, 16),
             kda_time_len=64, single_in=8, single_out=4, batch=3, batch_in=8, batch_out=3,
             prefill=32, spec_prompts=1, spec_tokens=4, spec_k=3, long_contexts=(64, 128),
             long_decode=3, long_chunk=64, repeats=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _llm(model: Path | str, device: torch.device, dtype: str = "float32", **kw):
    from kdaserve.engine.llm import LLM

    kw.setdefault("enable_prefix_caching", False)   # repeats must compute their prompts
    return LLM(str(model), device=str(device), dtype=dtype, **kw)


def _kda_backend(device: torch.device) -> str:
    from kdaserve.ops.registry import kda_ops

    return kda_ops(device).name


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


# ---- engine driving -------------------------------------------------------------------------
def _drive(llm, prompts: list[list[int]], max_tokens: int) -> dict:
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


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, length), generator=g).tolist()


# ---- 1. correctness -------------------------------------------------------------------------
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
                 "dtype": "float32", "kda_backend": _kda_backend(device)}
    for name, path in MODELS.items():
        with _counting_fla_calls(device) as calls:
            llm = _llm(path, device)
            dev_ids = _greedy(llm, prompts, sizes.correctness_tokens)
            backend = _kda_backend(device)
        del llm
        _free(device)
        with _cpu_reference(device) as reference:
            cpu_llm = _llm(path, torch.device("cpu"))
            cpu_ids = _greedy(cpu_llm, prompts, sizes.correctness_tokens)
            del cpu_llm
        out["cpu_reference"] = reference
        diffs = [(i, _first_diff(a, b)) for i, (a, b) in enumerate(zip(dev_ids, cpu_ids))]
        diffs = [{"prompt": i, "first_diff_position": p} for i, p in diffs if p is not None]
        out[name] = {"greedy_identical_cuda_vs_cpu": not diffs, "first_diffs": diffs,
                     "tokens_per_prompt": [len(x) for x in dev_ids],
                     "kda_backend": backend, "fla_chunk_calls": calls[0]}
    return out


# ---- 1b. the KDA chunk op ---------------------------------------------------------------------
def _kda_inputs(B: int, T: int, H: int, D: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1) * D ** -0.5
    k = F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, generator=g)
    gate = -torch.rand(B, T, H, D, generator=g) * 2
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, D, D, generator=g) * 0.1
    return tuple(x.to(device) for x in (q, k, v, gate, beta, s0))


def _fla_naive():
    """fla-core's naive recurrence, loaded by path (fla/__init__ imports triton), or None."""
    import importlib.util

    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    ms = importlib.util.spec_from_file_location("fla_kda_naive_bench", path)
    mod = importlib.util.module_from_spec(ms)
    ms.loader.exec_module(mod)
    return mod


def _time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()                         # warm-up (Triton compiles and autotunes on the first call)
    times = []
    for _ in range(max(repeats, 1)):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return round(_median(times) * 1e3, 3)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def kda_op(device: torch.device, sizes: Sizes) -> dict:
    from kdaserve.ops import kda as ref

    B, T, H, D = sizes.kda_check
    C = 64
    x = _kda_inputs(B, T, H, D, device)
    pad = (-T) % C                 # the reference takes whole chunks, as the model pads them
    padded = [F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in x[:4]]
    ref_o, ref_s, _ = ref.kda_chunk(*padded, F.pad(x[4], (0, 0, 0, pad)), x[5], C)
    ref_o = ref_o[:, :T]
    out: dict = {"shape_BTHD": [B, T, H, D], "device": str(device),
                 "reference_chunk_size": C, "max_abs_o": round(float(ref_o.abs().max()), 4)}
    naive = _fla_naive()
    if naive is not None:
        n_o, n_s = naive.naive_recurrent_kda(*x[:5], scale=1.0, initial_state=x[5],
                                             output_final_state=True)
        out["torch_ref_vs_fla_naive_max_abs_err"] = max(_err(ref_o, n_o), _err(ref_s, n_s))
    fla_chunk = None
    if device.type == "cuda":
        try:
            from kdaserve.ops.registry import _fla_chunk_factory

            fla_chunk = _fla_chunk_factory()
        except Exception as exc:  # noqa: BLE001 - fla-core or triton missing
            out["fla_chunk"] = f"unavailable: {type(exc).__name__}: {exc}"
    else:
        out["fla_chunk"] = "not run: fla's Triton kernels need a CUDA device"
    if fla_chunk is not None:
        f_o, f_s, _ = fla_chunk(*x, C)
        out["fla_chunk_vs_torch_ref_max_abs_err_o"] = _err(f_o, ref_o)
        out["fla_chunk_vs_torch_ref_max_abs_err_state"] = _err(f_s, ref_s)
        if naive is not None:
            out["fla_chunk_vs_fla_naive_max_abs_err"] = max(_err(f_o, n_o), _err(f_s, n_s))
    # one long prefill row, both chunked forms
    L = sizes.kda_time_len
    y = _kda_inputs(1, L, H, D, device, seed=1)
    timing = {"len": L, "torch_ref_ms": _time_ms(lambda: ref.kda_chunk(*y, C), device,
                                                    sizes.repeats)}
    if fla_chunk is not None:
        timing["fla_chunk_ms"] = _time_ms(lambda: fla_chunk(*y, C), device, sizes.repeats)
        timing["fla_speedup_vs_torch_ref"] = round(timing["torch_ref_ms"]
                                                   / max(timing["fla_chunk_ms"], 1e-9), 2)
    out["prefill_timing"] = timing
    return out


# ---- 2. throughput --------------------------------------------------------------------------
def throughput_one(path: Path, device: torch.device, dtype: str, sizes: Sizes,
                   threads: int | None = None) -> dict:
    llm = _llm(path, device, dtype, max_num_seqs=max(sizes.batch, 1),
               max_num_batched_tokens=max(4096, sizes.prefill),
               max_model_len=max(4096, sizes.prefill + 64), num_threads=threads)
    try:
        vocab = llm.engine.model_config.vocab_size
        single = _random_prompts(1, sizes.single_in, vocab, 1)
        batch = _random_prompts(sizes.batch, sizes.batch_in, vocab, 2)
        prefill = _random_prompts(1, sizes.prefill, vocab, 3)
        for p, n in ((single, 4), (batch, 2), (prefill, 1)):      # warm-up, every shape
            _drive(llm, p, n)
        r = sizes.repeats
        s_runs = [_drive(llm, single, sizes.single_out) for _ in range(r)]
        b_runs = [_drive(llm, batch, sizes.batch_out) for _ in range(r)]
        p_runs = [_drive(llm, prefill, 1) for _ in range(r)]
        s_tpot = _median([_median(x["steps"]) for x in s_runs if x["steps"]] or [float("nan")])
        b_tpot = _median([_median(x["steps"]) for x in b_runs if x["steps"]] or [float("nan")])
        return {
            "kda_backend": _kda_backend(device),
            "single_tpot_ms": round(s_tpot * 1e3, 3),
            "single_decode_tok_s": round(1 / s_tpot, 1),
            "single_output_tok_s": round(_median([x["tokens"] / x["seconds"] for x in s_runs]), 1),
            "batch32_output_tok_s": round(_median([x["tokens"] / x["seconds"]
                                                   for x in b_runs]), 1),
            "batch32_step_ms": round(b_tpot * 1e3, 3),
            "batch32_decode_tok_s": round(sizes.batch / b_tpot, 1),
            "prefill_ms": round(_median([x["ttft"] for x in p_runs]) * 1e3, 2),
            "prefill_tok_s": round(_median([sizes.prefill / x["ttft"] for x in p_runs]), 1),
        }
    finally:
        del llm
        _free(device)


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
                out[key] = _error(exc)
    return out


# ---- 3. long context ------------------------------------------------------------------------
def long_one(model_dir: Path, context: int, device: torch.device, sizes: Sizes) -> dict:
    """One request reaching `context` tokens (prompt, then long_decode greedy tokens), as
    kdaserve.bench.long.measure does on the CPU, on `device`."""
    from kdaserve.cache.spec import specs_for
    from kdaserve.model.registry import load_config

    decode = sizes.long_decode
    latent, state = specs_for(load_config(str(model_dir)), 16, "float32")
    memory = (context + 16) * latent.bytes_per_token + state.bytes_per_slot + (1 << 20)
    llm = _llm(model_dir, device, max_model_len=context, cache_memory=memory,
               max_num_batched_tokens=sizes.long_chunk, max_num_seqs=1)
    try:
        vocab = llm.engine.model_config.vocab_size
        prompt = _random_prompts(1, context - decode, vocab, 0)[0]
        _drive(llm, [prompt[:256]], 2)                                  # warm-up
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        r = _drive(llm, [prompt], decode)
        n = len(prompt)
        row = {"context": context, "prompt_tokens": n, "completed": r["tokens"] == decode,
               "prefill_s": round(r["ttft"], 3), "prefill_tok_s": round(n / r["ttft"], 1),
               "tpot_ms": round(_median(r["steps"]) * 1e3, 3) if r["steps"] else None,
               "cache_bytes": llm.engine.plan.request_bytes(context)}
        if device.type == "cuda":
            row["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        return row
    finally:
        del llm
        _free(device)


def long_context(device: torch.device, sizes: Sizes, deadline: float) -> dict:
    from kdaserve.bench.long import make_model_dir

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
                rows.append({"context": c, **_error(exc)})
    tpot = {r["context"]: r.get("tpot_ms") for r in rows}
    lo, hi = sizes.long_contexts[0], sizes.long_contexts[-1]
    ratio = (round(tpot[hi] / tpot[lo], 3) if tpot.get(hi) and tpot.get(lo) else None)
    return {"model": "bench tiny hybrid (kdaserve.bench.long.bench_config), fp32",
            "decode_tokens": sizes.long_decode, "max_num_batched_tokens": sizes.long_chunk,
            f"tpot_ratio_{_k(hi)}_{_k(lo)}": ratio, "runs": rows}


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


# ---- 4. speculative decoding ----------------------------------------------------------------
def spec_one(path: Path, device: torch.device, sizes: Sizes) -> dict:
    from kdaserve.bench.spec import measure
    from kdaserve.bench.spec_prompts import unseen_prompts
    from kdaserve.request import SamplingParams

    base = _llm(path, device)
    spec = _llm(path, device, speculative_method="dspark", num_speculative_tokens=sizes.spec_k)
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
        _free(device)


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
                out[name] = _error(exc)
    return out


# ---- the run ----------------------------------------------------------------------------------
def _error(exc: BaseException) -> dict:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": "".join(tb)[-3000:]}


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
        "long": lambda: long_context(device, sizes, deadline),
        "spec": lambda: spec_decode(device, sizes, deadline),
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
            result[name] = _error(exc)
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
