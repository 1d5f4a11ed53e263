"""`kdaserve bench kda`: the KDA recurrence per layer, torch reference vs the compiled CPU
kernel, side by side in one run, on the demo model's shape (H=4, K=V=64): a batch of decode
rows, one verification row of k+1 positions, and a prefill batch. Times are the best of
`--repeats` rounds of `--iters` calls (noise only ever slows a call down)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kdaserve.ops import kda as ref
from kdaserve.ops.cpu_kernels import kda_recurrent_slots_kernel
from kdaserve.ops.registry import _compiled_chunk, _compiled_recurrent_slots


def _best_us(fn: Callable[[], object], iters: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e6


def _inputs(B: int, L: int, H: int, D: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, L, H, D, generator=g), dim=-1) * D ** -0.5
    k = F.normalize(torch.randn(B, L, H, D, generator=g), dim=-1)
    v = torch.randn(B, L, H, D, generator=g)
    gate = -torch.rand(B, L, H, D, generator=g)
    beta = torch.rand(B, L, H, generator=g)
    return q, k, v, gate, beta


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    kernel = kda_recurrent_slots_kernel()
    if kernel is None:
        print(json.dumps({"error": "the compiled kernel is unavailable (no C compiler?)"}))
        return 1
    compiled_slots, compiled_chunk = _compiled_recurrent_slots(kernel), _compiled_chunk(kernel)
    H, D, it, rep = args.heads, args.head_dim, args.iters, args.repeats
    result: dict = {"heads": H, "head_dim": D, "threads": args.threads}
    for name, B, L in (("decode", args.decode_rows, 1), ("verify", 1, args.k + 1)):
        store = torch.randn(B + 8, H, D, D) * 0.1
        slots = torch.randperm(B + 8)[:B]
        scratch = torch.empty(B + 8, H, D, D)
        x = _inputs(B, L, H, D)
        keep = L > 1
        t_ref = _best_us(lambda: ref.kda_recurrent_slots(store, slots, *x, keep_states=keep,
                                                         scratch=scratch), it, rep)
        t_c = _best_us(lambda: compiled_slots(store, slots, *x, keep_states=keep), it, rep)
        result[name] = {"rows": B, "positions": L, "torch_us": round(t_ref, 1),
                        "compiled_us": round(t_c, 1), "speedup": round(t_ref / t_c, 2)}
    B, L = args.prefill_rows, args.prefill_len
    x = _inputs(B, L, H, D)
    s0 = torch.zeros(B, H, D, D)
    t_ref = _best_us(lambda: ref.kda_chunk(*x, s0, 16), max(1, it // 20), rep)
    t_c = _best_us(lambda: compiled_chunk(*x, s0, 16), max(1, it // 20), rep)
    result["prefill"] = {"rows": B, "positions": L, "torch_chunk16_us": round(t_ref, 1),
                         "compiled_us": round(t_c, 1), "speedup": round(t_ref / t_c, 2)}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--decode-rows", type=int, default=64)
    p.add_argument("--k", type=int, default=7, help="drafts of the verification row")
    p.add_argument("--prefill-rows", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
