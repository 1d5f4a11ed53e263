"""Today's layout: the runner lives in the engine core's process; a step is a method call (the
message object itself is handed over, nothing is copied or serialized)."""

from __future__ import annotations

from kdaserve.cache.ops import CacheOp, CacheOutcome
from kdaserve.engine.executor.base import Executor
from kdaserve.engine.runner import ModelRunner
from kdaserve.outputs import ModelRunnerOutput, SchedulerOutput
from kdaserve.structured.spec import GuidedDecoding


class UniProcExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def run_cache_ops(self, ops: list[CacheOp]) -> CacheOutcome:
        return self.runner.cache_ops.run(ops)

    def validate_guided(self, guided: GuidedDecoding) -> None:
        self.runner.structured.validate(guided)

    def num_forward_tokens(self) -> int:
        return self.runner.num_forward_tokens

    def transfer_stats(self) -> dict:
        return self.runner.cache_ops.stats
