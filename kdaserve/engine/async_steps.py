"""The engine loop with one step in flight (async scheduling, `--async-scheduling`).

Each call plans step N+1 and starts it, then takes in step N's result: the scheduler, the
step message and the cache bookkeeping of N+1 run while the runner computes N (on its own
thread here; on a GPU, while the device runs N's kernels), and the runner starts N+1 as soon
as N is done. engine/lookahead.py says how a step is planned before the tokens it continues
are known.

A failed step also voids the one started after it (its PENDING inputs never came): that one is
waited for, every token in flight is dropped, and the requests of both are retried as a failed
synchronous step's are (EngineCore._on_step_failure).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kdaserve.engine.executor.base import ExecutorError
from kdaserve.engine.lookahead import dispatched, strip_pending
from kdaserve.outputs import ModelRunnerOutput, RequestDelta, SchedulerOutput

if TYPE_CHECKING:
    from kdaserve.engine.core import EngineCore


@dataclass
class InFlight:
    out: SchedulerOutput
    result: Future[ModelRunnerOutput]
    started: float


class StepPipeline:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.inflight: InFlight | None = None

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def step(self) -> list[RequestDelta]:
        core = self.core
        sched = core.scheduler
        out = sched.schedule()
        started = None
        if not out.is_empty or out.ops:  # (cache operations alone go the same way, in order)
            msg = core._messages.attach(out, sched.requests)
            started = InFlight(out, core.executor.submit(msg), time.perf_counter())
            dispatched(sched.requests, out)
        prev, self.inflight = self.inflight, started
        return self._collect(prev) if prev is not None else []

    def drain(self) -> list[RequestDelta]:
        prev, self.inflight = self.inflight, None
        return self._collect(prev) if prev is not None else []

    def _collect(self, step: InFlight) -> list[RequestDelta]:
        try:
            result = step.result.result()
        except ExecutorError:
            raise                       # a worker is gone: fatal, as in the synchronous loop
        except Exception as exc:
            return self._failed(step, exc)
        if len(step.out.sequences) == 1:
            self.core.scheduler.cleared(step.out.sequences[0].request_id)
        return self.core._finish(step.out, result, time.perf_counter() - step.started,
                                 dispatched=True)

    def _failed(self, step: InFlight, exc: Exception) -> list[RequestDelta]:
        core, sched = self.core, self.core.scheduler
        later, self.inflight = self.inflight, None
        voided: list[str] = []
        if later is not None:
            try:
                later.result.result()
            except Exception:  # noqa: BLE001 - voided either way
                pass
            mine = {s.request_id for s in step.out.sequences}
            voided = [s.request_id for s in later.out.sequences if s.request_id not in mine]
        for req in sched.requests.values():
            strip_pending(req)
        for rid in voided:
            sched.reset_for_retry(rid)
            core._messages.forget(rid)
        return core._on_step_failure(step.out, exc)
