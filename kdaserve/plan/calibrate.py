"""`kdaserve plan --calibrate`: the simulator against the engine on this machine.

The demo model serves a `kdaserve bench serve` workload in-process (the same lengths and
Poisson arrivals, kdaserve/plan/workload.py `like_bench_serve`; EOS ignored), on the wall
clock: a request is added once its arrival time has passed, at the next step boundary (as the
server's engine core takes it in), and its TTFT is the end of the step that gave its first
token less its arrival. Every step's shape and duration are recorded.

The step cost model is fitted to the steps of a short probe (prompts of several lengths at
once, then decode batches of every size down to one) and of the workload itself: the fit and
the check run under the same conditions, which on a shared machine move from one minute to the
next. Then the simulator (kdaserve/plan/simulate.py) serves the same workload with the same
scheduler and cache configuration and that cost model, and the two are compared:
`simulated_vs_measured_throughput` and `simulated_vs_measured_ttft_p50` (simulated over
measured; 1.0 is exact).
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass
from typing import Any

from kdaserve.bench.serve import RequestResult, summarize
from kdaserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kdaserve.outputs import SchedulerOutput
from kdaserve.plan.simulate import simulate
from kdaserve.plan.step_cost import StepShape, fit_linear
from kdaserve.plan.workload import Arrival, like_bench_serve
from kdaserve.request import SamplingParams


@dataclass(frozen=True)
class CalibrationWorkload:
    num_prompts: int = 24
    request_rate: float = 8.0
    input_len: int = 64
    output_len: int = 16
    range_ratio: float = 0.5
    seed: int = 0
    max_num_batched_tokens: int = 256


class _StepLog:
    """Each step's shape (told by the engine before it runs) and its wall-clock seconds."""

    def __init__(self) -> None:
        self.shapes: list[StepShape] = []
        self.seconds: list[float] = []
        self._pending: StepShape | None = None

    def scheduled(self, out: SchedulerOutput) -> None:
        self._pending = StepShape.of(out) if not out.is_empty else None

    def timed(self, seconds: float) -> None:
        if self._pending is not None:
            self.shapes.append(self._pending)
            self.seconds.append(seconds)
        self._pending = None


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)


def _drain(core, log: _StepLog | None) -> None:
    while core.has_unfinished():
        t = time.perf_counter()
        core.step()
        if log is not None:
            log.timed(time.perf_counter() - t)


def _probe(core, log: _StepLog, w: CalibrationWorkload, vocab: int) -> None:
    """Prompt chunks of several lengths, then decode batches shrinking from 6 rows to 1."""
    rng = random.Random(w.seed + 1)
    for i, n in enumerate((w.input_len // 4, w.input_len // 2, w.input_len, 2 * w.input_len,
                           3 * w.input_len, w.input_len)):
        core.add_request(f"probe{i}", [rng.randrange(vocab) for _ in range(max(1, n))],
                         _params(4 + 2 * i))
    _drain(core, log)


def _serve(core, log: _StepLog, workload: list[Arrival]) -> dict[str, Any]:
    """The workload on the wall clock; bench serve's summary of it."""
    results = [RequestResult(ok=False, prompt_tokens=len(a.prompt_token_ids))
               for a in workload]
    first: dict[int, float] = {}
    start = time.perf_counter()
    nxt = 0
    while nxt < len(workload) or core.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(workload) and workload[nxt].arrival_s <= now:
            a = workload[nxt]
            core.add_request(str(nxt), list(a.prompt_token_ids), _params(a.output_len))
            nxt += 1
        if not core.has_unfinished():
            time.sleep(max(0.0, workload[nxt].arrival_s - now))
            continue
        t = time.perf_counter()
        deltas = core.step()
        end = time.perf_counter()
        log.timed(end - t)
        for d in deltas:
            i = int(d.request_id)
            r = results[i]
            if d.new_token_ids:
                first.setdefault(i, end - start)
            r.output_tokens = d.num_output_tokens or r.output_tokens
            if d.finished:
                r.ok = d.error is None and r.output_tokens > 0
                r.ttft_s = first.get(i, end - start) - workload[i].arrival_s
                r.latency_s = end - start - workload[i].arrival_s
    return summarize(results, time.perf_counter() - start)


def calibrate(w: CalibrationWorkload = CalibrationWorkload(), model: str | None = None,
              cache_memory_bytes: int = 64 << 20) -> dict[str, Any]:
    from kdaserve.assets import default_model_path
    from kdaserve.engine.core import EngineCore

    config = EngineConfig(
        model=str(model or default_model_path()), num_threads=1,
        cache=CacheConfig(cache_memory_bytes=cache_memory_bytes),
        scheduler=SchedulerConfig(max_num_batched_tokens=w.max_num_batched_tokens,
                                  max_model_len=4 * (w.input_len + w.output_len) + 64))
    core = EngineCore(config)
    vocab = core.model_config.vocab_size
    log = _StepLog()
    core.on_schedule = log.scheduled
    workload = like_bench_serve(w.num_prompts, w.request_rate, w.input_len, w.output_len,
                                w.range_ratio, vocab, w.seed)
    core.add_request("warmup", list(range(2, 10)), _params(4))
    _drain(core, None)                       # first use: kernels, allocator, caches
    gc.collect()
    gc.disable()                             # a collection inside a timed step is not its cost
    try:
        _probe(core, log, w, vocab)
        measured = _serve(core, log, workload)
    finally:
        gc.enable()
    cost, rel_rms = fit_linear(log.shapes, log.seconds)
    sim = simulate(workload, core.plan, config.cache, core.scheduler.config, cost)
    simulated = sim.summary

    def ratio(key: str) -> float:
        return simulated[key] / measured[key] if measured[key] else float("nan")

    return {
        "model": config.model, "workload": w.__dict__,
        "step_cost_fit": {**cost.to_dict(), "steps": len(log.shapes),
                          "relative_rms_error": rel_rms},
        "measured": measured, "simulated": sim.to_dict(),
        "simulated_vs_measured_throughput": ratio("output_throughput"),
        "simulated_vs_measured_ttft_p50": ratio("median_ttft_ms"),
    }
