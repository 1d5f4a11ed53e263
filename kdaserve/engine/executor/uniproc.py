"""Today's layout: the runner lives in the engine core's process; a step is a method call (the
message object itself is handed over, nothing is copied or serialized)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from kdaserve.cache.ops import CacheOp, CacheOutcome
from kdaserve.engine.executor.base import Executor
from kdaserve.engine.runner import ModelRunner
from kdaserve.outputs import ModelRunnerOutput, SchedulerOutput
from kdaserve.structured.spec import GuidedDecoding


class UniProcExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._thread: ThreadPoolExecutor | None = None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def submit(self, out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """On one runner thread, in order: the runner's state is only ever touched there
        while steps are in flight (async scheduling, engine/lookahead.py)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kdaserve-runner")
        return self._thread.submit(self.runner.execute, out)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def run_cache_ops(self, ops: list[CacheOp]) -> CacheOutcome:
        return self.runner.cache_ops.run(ops)

    def validate_guided(self, guided: GuidedDecoding) -> None:
        self.runner.structured.validate(guided)

    def num_forward_tokens(self) -> int:
        return self.runner.num_forward_tokens

    def transfer_stats(self) -> dict:
        return self.runner.cache_ops.stats
