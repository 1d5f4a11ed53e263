"""The seam between the engine core (scheduler, rank 0) and the model runner(s): an Executor
takes a self-contained `SchedulerOutput` and returns the `ModelRunnerOutput` of rank 0."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kdaserve.cache.ops import CacheOp, OpFailure
from kdaserve.outputs import ModelRunnerOutput, SchedulerOutput
from kdaserve.structured.spec import GuidedDecoding


class ExecutorError(RuntimeError):
    """The executor cannot go on (a worker died, timed out or failed to start): fatal to the
    engine, never isolated to one request."""


class Executor(ABC):
    world_size: int = 1

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def run_cache_ops(self, ops: list[CacheOp]) -> list[OpFailure]:
        """Offload stores/loads/drops outside a step (flush)."""

    @abstractmethod
    def validate_guided(self, guided: GuidedDecoding) -> None:
        """Compile (or find cached) a grammar; raises GuidedDecodingError for a bad one."""

    def num_forward_tokens(self) -> int:
        return 0

    def transfer_stats(self) -> dict:
        """Bytes the offload tiers moved, per tier (rank 0's; every rank moves its share)."""
        return {}

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
