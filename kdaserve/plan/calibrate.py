"""`kdaserve plan --calibrate`: the simulator against the engine on this machine.

The demo model serves a `kdaserve bench serve` workload in-process (the same lengths and
Poisson arrivals, kdaserve/plan/workload.py `like_bench_serve`; EOS ignored): a request is
added once its arrival time has passed, at the next step boundary (as the server's engine
core takes it in), and its TTFT is the end of the step that gave its first token less its
arrival. Every step's shape and duration are recorded.

The clock is the process's CPU time by default, plus the idle gaps between arrivals (skipped,
not slept): what the run would take on a dedicated core. On a machine shared with other work
the wall clock also counts the time the process waits for a core, which is neither the
engine's cost nor anything a cost model of steps can predict; `clock="wall"` (`--wall-clock`)
measures that instead, and sleeps through the gaps. Torch runs one thread here, so the two
agree on a quiet machine.

The step cost model (kdaserve/plan/step_cost.py) is fitted to the workload's own measured
steps: the fit and the check run under the same conditions (a probe of other shapes run
before the workload was tried: its first-of-a-kind steps cost more than the same shapes later,
and biased the simulated TTFT by about +10%). Then the simulator (kdaserve/plan/simulate.py)
serves the same workload with the same scheduler and cache configuration and that cost model,
and the two are compared: `simulated_vs_measured_throughput` and
`simulated_vs_measured_ttft_p50` (simulated over measured; 1.0 is exact). What the comparison
checks is everything besides the per-step cost: that the simulated scheduler forms the same
batches at the same moments, so that queueing, batching and the arrival process add up to the
same latencies.
"""

from __future__ import annotations

import gc
import math
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


class Clock:
    """Seconds since the start: CPU time of this process ("cpu") or the wall clock ("wall"),
    plus the idle time skipped while waiting for the next arrival."""

    def __init__(self, kind: str = "cpu") -> None:
        if kind not in ("cpu", "wall"):
            raise ValueError(f"clock must be 'cpu' or 'wall', got {kind!r}")
        self._raw = time.process_time if kind == "cpu" else time.perf_counter
        self._sleep = kind == "wall"
        self._skipped = 0.0
        self._start = self._raw()

    def now(self) -> float:
        return self._raw() - self._start + self._skipped

    def wait_until(self, t: float) -> None:
        gap = t - self.now()
        if gap <= 0:
            return
        if self._sleep:
            time.sleep(gap)
        else:
            self._skipped += gap


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


def _drain(core, log: _StepLog | None, clock: Clock) -> None:
    while core.has_unfinished():
        t = clock.now()
        core.step()
        if log is not None:
            log.timed(clock.now() - t)


def _serve(core, log: _StepLog, workload: list[Arrival], clock: Clock) -> dict[str, Any]:
    """The workload on `clock`; bench serve's summary of it."""
    results = [RequestResult(ok=False, prompt_tokens=len(a.prompt_token_ids))
               for a in workload]
    first: dict[int, float] = {}
    start = clock.now()
    nxt = 0
    while nxt < len(workload) or core.has_unfinished():
        now = clock.now() - start
        while nxt < len(workload) and workload[nxt].arrival_s <= now:
            a = workload[nxt]
            core.add_request(str(nxt), list(a.prompt_token_ids), _params(a.output_len))
            nxt += 1
        if not core.has_unfinished():
            clock.wait_until(start + workload[nxt].arrival_s)
            continue
        t = clock.now()
        deltas = core.step()
        end = clock.now()
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
    return summarize(results, clock.now() - start)


def calibrate(w: CalibrationWorkload = CalibrationWorkload(), model: str | None = None,
              cache_memory_bytes: int = 64 << 20, clock: str = "cpu") -> dict[str, Any]:
    from kdaserve.assets import default_model_path
    from kdaserve.engine.core import EngineCore

    config = EngineConfig(
        model=str(model or default_model_path()), num_threads=1,
        cache=CacheConfig(cache_memory_bytes=cache_memory_bytes),
        scheduler=SchedulerConfig(max_num_batched_tokens=w.max_num_batched_tokens,
                                  max_model_len=4 * (w.input_len + w.output_len) + 64,
                                  num_scheduler_steps=1))   # the simulator's steps are single
    core = EngineCore(config)
    vocab = core.model_config.vocab_size
    log = _StepLog()
    core.on_schedule = log.scheduled
    workload = like_bench_serve(w.num_prompts, w.request_rate, w.input_len, w.output_len,
                                w.range_ratio, vocab, w.seed)
    core.add_request("warmup", list(range(2, 10)), _params(4))
    ticks = Clock(clock)
    _drain(core, None, ticks)                # first use: kernels, allocator, caches
    gc.collect()
    gc.disable()                             # a collection inside a timed step is not its cost
    try:
        measured = _serve(core, log, workload, ticks)
    finally:
        gc.enable()
    cost, rel_rms = fit_linear(log.shapes, log.seconds)
    sim = simulate(workload, core.plan, config.cache, core.scheduler.config, cost)
    simulated = sim.summary

    def ratio(key: str) -> float:
        return simulated[key] / measured[key] if measured[key] else float("nan")

    return {
        "model": config.model, "clock": clock,
        "workload": {**w.__dict__, "request_rate": w.request_rate
                     if math.isfinite(w.request_rate) else "inf"},     # JSON has no inf
        "step_cost_fit": {**cost.to_dict(), "steps": len(log.shapes),
                          "relative_rms_error": rel_rms},
        "measured": measured, "simulated": sim.to_dict(),
        "simulated_vs_measured_throughput": ratio("output_throughput"),
        "simulated_vs_measured_ttft_p50": ratio("median_ttft_ms"),
    }
