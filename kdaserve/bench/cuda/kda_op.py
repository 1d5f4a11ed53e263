"""The `kda_op` section: fla-core's chunk_kda (what the registry calls on CUDA) against
kdaserve's torch reference and fla's naive recurrence, and both chunked forms timed."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kdaserve.bench.cuda.driver import median, sync
from kdaserve.bench.cuda.workload import Sizes


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
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return round(median(times) * 1e3, 3)


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
