"""`kdaserve bench blocks --against-csrc DIR | --against-cflags FLAGS`: two builds of the fused
decode blocks side by side, alternating every decode step in one process.

This host's speed moves by a third over seconds (docs/benchmarks.md), so two builds timed
one run after the other differ by more than most kernel changes do, and even runs alternated
pair by pair left 8-15% between the pairs' ratios. Here build A (this checkout's csrc/ as
configured) and build B (another csrc/ directory, such as an older checkout's
kdaserve/ops/csrc, and/or other -D flags) run the same requests in the same process on the
same weights, B's calls in every other step: both meet the same moments. Each block call is
timed as `bench blocks` times it; the report gives each block's microseconds a step under A
and B, and their ratio. Identical code on both sides read within 2% of 1.0 on the Zen 4 host.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch

from kdaserve.ops import cpu_kernels

_BLOCKS = ("kda", "mla", "mlp", "moe", "mix", "head")


class Alternating:
    """Two kernel tables behind one: each block call goes to the table of the current step,
    timed; the head's call ends a step and hands the next to the other table."""

    def __init__(self, tables: list) -> None:
        self.tables = tables
        self.side = 0
        self.us: Counter = Counter()       # (side, block) -> nanoseconds
        self.steps = [0, 0]

    def __getattr__(self, name: str):
        if name not in _BLOCKS:
            return getattr(self.tables[0], name)     # embed, threads, parallel: not timed

        def timed(*args):
            side = self.side
            t = time.perf_counter_ns()
            getattr(self.tables[side], name)(*args)
            self.us[(side, name)] += time.perf_counter_ns() - t
            if name == "head":
                self.steps[side] += 1
                self.side ^= 1
        return timed

    def clear(self) -> None:
        self.us.clear()
        self.steps = [0, 0]

    def report(self) -> dict:
        out: dict = {"steps": list(self.steps)}
        for name in _BLOCKS:
            a, b = self.us[(0, name)], self.us[(1, name)]
            if not (a and b and all(self.steps)):
                continue
            out[name] = {"a_us": round(a / self.steps[0] / 1e3, 1),
                         "b_us": round(b / self.steps[1] / 1e3, 1),
                         "b_over_a": round((b / self.steps[1]) / (a / self.steps[0]), 3)}
        a = sum(v for (s, _), v in self.us.items() if s == 0) / max(self.steps[0], 1)
        b = sum(v for (s, _), v in self.us.items() if s == 1) / max(self.steps[1], 1)
        if a and b:
            out["blocks"] = {"a_us": round(a / 1e3, 1), "b_us": round(b / 1e3, 1),
                             "b_over_a": round(b / a, 3)}
        return out


def tables(weights: str, csrc: str | None, cflags: str) -> list:
    """[the default build's table, the other build's]."""
    base = cpu_kernels.decode_block_kernels(weights)
    src = Path(csrc) if csrc else cpu_kernels._CSRC
    if not (src / "decode_cpu.c").is_file():
        raise SystemExit(f"--against-csrc: no decode_cpu.c in {src}")
    lib = cpu_kernels.build_library(src / "decode_cpu.c", cflags)
    if base is None or lib is None:
        raise SystemExit("bench blocks --against-*: a build of decode_cpu.c failed")
    other = cpu_kernels.decode_table(lib, weights)
    if not (base.parallel and other.parallel):
        # without OpenMP a step's rows split over threads of ours (fused_rows.split_parts),
        # each calling the head: the steps would not alternate
        raise SystemExit("bench blocks --against-*: needs the blocks built with OpenMP")
    return [base, other]


def weights_of(model: torch.nn.Module) -> str:
    """Which copy of the blocks the model takes (fused_decode.fused_decoder's choice)."""
    from kdaserve.model.packed_args import has_packed

    return "q" if has_packed(model) else "f32" if model.dtype == torch.float32 else "bf16"
