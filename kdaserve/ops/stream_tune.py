"""How far ahead a lone decode row's INT weight streams are prefetched (csrc/int_row4.h),
measured once a machine (ops/stream_ahead.py holds the choice for the kernel libraries).

The best distance is the memory system's, not the code's: on the Zen 4 machine the kernels were
tuned on, INT8 ran best at 256 bytes (1,024: 0.90x), while on a Xeon with AMX 1,024 bytes ran
INT8 1.08x and INT4 1.29-1.36x faster than 256 (docs/benchmarks.md, thirty-third session). So
when the engine loads a model whose packed weights do not fit the last-level cache (and a
fused decoder asks, for processes without an engine), a lone row's product runs over a pool of
cold matrices at each candidate, in turns, and every kernel library then takes the nearest of
the fastest (kdaserve_set_stream_ahead). The result is kept under the kernel cache, keyed by
the CPU, the kernels' build, the bits and the thread count, so a machine measures once. The
distance moves no result: only when the weights are asked for.

KDASERVE_STREAM_AHEAD=BYTES sets it without measuring; 0 keeps the kernels' built-in value
(an A/B build's -DIDOT_STREAM_AHEAD).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path

import torch

from kdaserve.ops import cpu_int_linear, cpu_isa, cpu_kernels, int_quant, stream_ahead
from kdaserve.ops.stream_ahead import choose

log = logging.getLogger("kdaserve")

CANDIDATES = (256, 512, 1024, 2048)
MARGIN = 0.02                      # distances this close to the fastest count as even
# the pool's matrices, [N x K] in groups of 128: wide, so that a call's fixed costs stay small
_N, _K, _GROUP = 8192, 4096, 128


def measure(bits: int, pool_bytes: int, candidates: tuple[int, ...] = CANDIDATES,
            rounds: int = 3) -> dict[int, float]:
    """The best seconds of a pass over the pool at each distance: one input row through every
    matrix in a shuffled order, the distances taking turns round after round."""
    row = int_quant.row_bytes(_K, bits)
    # the bytes' values move no instruction, so a constant fill serves
    pool = [torch.full((_N, row), 0x5A, dtype=torch.uint8)
            for _ in range(max(4, pool_bytes // (_N * row)))]
    scale = torch.ones(_N, int_quant.num_groups(_K, _GROUP))
    x = torch.randn(1, _K, generator=torch.Generator().manual_seed(0))
    rng = random.Random(0)
    best = dict.fromkeys(candidates, float("inf"))
    for m in pool[:2]:                                      # the kernel built and warm
        cpu_int_linear.rows_product(x, m, scale, None, bits, _GROUP, _N, act8=True)
    saved = stream_ahead.chosen()
    try:
        for r in range(rounds):
            order = list(range(len(pool)))
            rng.shuffle(order)
            turn = list(candidates[r % len(candidates):] + candidates[:r % len(candidates)])
            for c in turn:
                choose(c)
                t = time.perf_counter()
                for i in order:
                    cpu_int_linear.rows_product(x, pool[i], scale, None, bits, _GROUP, _N,
                                                act8=True)
                best[c] = min(best[c], time.perf_counter() - t)
    finally:
        choose(saved)
    return best


def pick(seconds: dict[int, float]) -> int:
    """The shortest distance within MARGIN of the fastest: the pool has the memory to itself,
    the engine's step shares the caches with the rest of the model, where the nearer of two
    even distances ran faster (on the Xeon: 1,024 bytes 1.10x 2,048 in the engine, even in the
    pool)."""
    best = min(seconds.values())
    return min(c for c, s in seconds.items() if s <= (1 + MARGIN) * best)


def _cache_file(bits: int, threads: int) -> Path:
    build = cpu_kernels.library_name("int_linear_cpu.c") or ""
    key = hashlib.sha256(f"{cpu_isa.cpu_model()}|{cpu_isa.requested()}|{build}|{bits}|{threads}"
                         .encode())
    return cpu_kernels.tune_dir() / f"stream-ahead-{key.hexdigest()[:16]}.json"


def _free_bytes() -> int:
    """Memory the pool can take: MemAvailable (the page cache counts), else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def tune(weight_bytes: int, bits: int, threads: int | None = None) -> int | None:
    """The distance for a model of `weight_bytes` packed bytes of `bits`: the environment's,
    this machine's measured one, or a measurement now when the weights are past the cache.
    None: left as built (weights in cache, no kernels, or KDASERVE_STREAM_AHEAD=0)."""
    env = os.environ.get(stream_ahead.ENV)
    if stream_ahead.chosen() is not None and env is None:     # this process has measured
        return stream_ahead.chosen()
    if env is not None:
        if not env.strip().isdigit():
            raise ValueError(f"{stream_ahead.ENV} takes a number of bytes (0: as built), "
                             f"not {env!r}")
        if int(env) > 0:
            choose(int(env))
        return stream_ahead.chosen()
    llc = cpu_isa.llc_bytes()
    if weight_bytes <= llc or bits not in (4, 8) or not cpu_int_linear.available():
        return stream_ahead.chosen()
    threads = threads or torch.get_num_threads()
    path = _cache_file(bits, threads)
    try:
        choose(int(json.loads(path.read_text())["bytes"]))
        return stream_ahead.chosen()
    except (OSError, ValueError, KeyError):
        pass
    pool = min(max(256 << 20, 2 * llc), 1 << 30)
    free = _free_bytes()
    if pool > free // 4:               # a model near the RAM's size: no room to measure
        log.info("kdaserve stream prefetch: %d MiB free, too little to measure; %d bytes ahead",
                 free >> 20, stream_ahead.current())
        return stream_ahead.chosen()
    t = time.perf_counter()
    seconds = measure(bits, pool)
    choose(pick(seconds))
    log.info("kdaserve stream prefetch: INT%d weights read %d bytes ahead (measured in %.1f s: "
             "%s)", bits, stream_ahead.chosen(), time.perf_counter() - t,
             ", ".join(f"{c}: {s * 1e3:.1f} ms" for c, s in seconds.items()))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"bytes": stream_ahead.chosen(), "bits": bits,
                                    "threads": threads,
                                    "seconds": {str(c): s for c, s in seconds.items()}}))
    except OSError:
        pass
    return stream_ahead.chosen()
