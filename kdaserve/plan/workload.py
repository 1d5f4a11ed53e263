"""The requests `kdaserve plan --simulate` and `--calibrate` run: when each arrives, its prompt
token ids and how many tokens it generates (EOS ignored, as `kdaserve bench serve` asks).

Arrivals are a Poisson process drawn like `kdaserve bench serve` draws them (the first at 0,
then exponential gaps; rate inf: all at 0), or read from a trace: one JSON object a line,
`{"arrival_s": 0.5, "prompt_len": 812, "output_len": 128, "shared_prefix_len": 512}`
(`shared_prefix_len` optional: that many leading tokens are the workload's common prefix).
Lengths are a distribution: `N` (fixed), `uniform:LO:HI`, `exp:MEAN` (at least 1).
`--prefix-share P` makes the first P of every prompt's tokens one common prefix (a system
prompt): the prefix cache's hits depend on it.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from kdaserve.bench.serve import sample_lengths


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    prompt_token_ids: list[int]
    output_len: int


def length_sampler(spec: str, rng: random.Random):
    """A function drawing one length from `spec` (see the module docstring)."""
    kind, _, rest = spec.partition(":")
    try:
        if not rest:
            n = int(kind)
            if n < 1:
                raise ValueError
            return lambda: n
        if kind == "uniform":
            lo, hi = (int(v) for v in rest.split(":"))
            if not 1 <= lo <= hi:
                raise ValueError
            return lambda: rng.randint(lo, hi)
        if kind == "exp":
            mean = float(rest)
            if mean < 1:
                raise ValueError
            return lambda: max(1, round(rng.expovariate(1.0 / mean)))
    except ValueError:
        pass
    raise ValueError(f"length distribution {spec!r}: expected N, uniform:LO:HI or exp:MEAN")


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """`kdaserve bench serve`'s schedule: a request, then an exponential gap, and so on."""
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return out


def _prompt(length: int, shared: int, prefix: list[int], vocab: int,
            rng: random.Random) -> list[int]:
    shared = min(shared, length - 1)        # at least one token of its own: a distinct prompt
    return prefix[:shared] + [rng.randrange(vocab) for _ in range(length - shared)]


def synthetic(num_requests: int, rate: float, prompt_len: str, output_len: str, vocab: int,
              prefix_share: float = 0.0, seed: int = 0) -> list[Arrival]:
    if not 0.0 <= prefix_share < 1.0:
        raise ValueError("--prefix-share must be in [0, 1)")
    rng = random.Random(seed)
    times = arrival_times(num_requests, rate, rng)
    plen, olen = length_sampler(prompt_len, rng), length_sampler(output_len, rng)
    lens = [(plen(), olen()) for _ in range(num_requests)]
    prefix = [rng.randrange(vocab) for _ in range(max(p for p, _ in lens))]
    return [Arrival(t, _prompt(p, int(p * prefix_share), prefix, vocab, rng), o)
            for t, (p, o) in zip(times, lens)]


def like_bench_serve(num_prompts: int, rate: float, input_len: int, output_len: int,
                     range_ratio: float, vocab: int, seed: int = 0) -> list[Arrival]:
    """`kdaserve bench serve`'s workload with token ids for words: the same lengths
    (`sample_lengths`) and Poisson arrivals, prompts random over the vocabulary."""
    rng = random.Random(seed)
    ins = sample_lengths(num_prompts, input_len, range_ratio, rng)
    outs = sample_lengths(num_prompts, output_len, range_ratio, rng)
    times = arrival_times(num_prompts, rate, rng)
    return [Arrival(t, [rng.randrange(vocab) for _ in range(i)], o)
            for t, i, o in zip(times, ins, outs)]


def from_trace(path: str | Path, vocab: int, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()
            if line.strip()]
    longest = max((r.get("shared_prefix_len", 0) for r in rows), default=0)
    prefix = [rng.randrange(vocab) for _ in range(longest)]
    out = [Arrival(float(r["arrival_s"]),
                   _prompt(int(r["prompt_len"]), int(r.get("shared_prefix_len", 0)), prefix,
                           vocab, rng), int(r["output_len"])) for r in rows]
    return sorted(out, key=lambda a: a.arrival_s)
