"""The seam between the engine core (scheduler, rank 0) and the model runner(s): an Executor
takes a self-contained `SchedulerOutput` and returns the `ModelRunnerOutput` of rank 0."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from kdaserve.cache.ops import CacheOp, CacheOutcome
from kdaserve.outputs import ModelRunnerOutput, SchedulerOutput
from kdaserve.structured.spec import GuidedDecoding


class ExecutorError(RuntimeError):
    """The executor cannot go on (a worker died, timed out or failed to start): fatal to the
    engine, never isolated to one request."""


class Executor(ABC):
    world_size: int = 1

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    def submit(self, out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start a step; its result comes through the future. Here it runs before this
        returns; the in-process executor runs it on its runner thread (async scheduling)."""
        fut: Future[ModelRunnerOutput] = Future()
        try:
            fut.set_result(self.execute(out))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the step
            fut.set_exception(exc)
        return fut

    @abstractmethod
    def run_cache_ops(self, ops: list[CacheOp]) -> CacheOutcome:
        """Cache operations outside a step (flushing the device cache to the offload tiers)."""

    @abstractmethod
    def validate_guided(self, guided: GuidedDecoding) -> None:
        """Compile (or find cached) a grammar; raises GuidedDecodingError for a bad one."""

    def num_forward_tokens(self) -> int:
        return 0

    def transfer_stats(self) -> dict:
        """Bytes the offload tiers moved, per tier (rank 0's; every rank moves its share)."""
        return {}

    def check_alive(self) -> None:
        """Raise ExecutorError when a worker is gone (the engine calls it while idle, too: a
        rank that dies between requests must not wait for the next one to be noticed)."""

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""


class RankExecutor(Executor):
    """An executor whose ranks run the worker's message loop (spawned processes, torchrun,
    Ray): every request is a message `_call` sends to rank 0; data-parallel layouts place each
    request on a rank first. Subclasses set `_finalizer` (what stops the ranks) and define
    `_call`."""

    def _init_ranks(self, config, structured) -> None:
        par = config.parallel
        self._structured = structured    # grammars are validated here, compiled again per rank
        self.world_size = par.world_size
        self._placement = None
        if par.data_parallel_size > 1:
            from kdaserve.distributed.data_parallel import Placement

            self._placement = Placement(par.data_parallel_size)
        self._closed = False

    @abstractmethod
    def _call(self, msg: tuple, doing: str): ...

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self._placement is not None:
            out.dp_ranks = self._placement.assign(out)
        return self._call(("execute", out), "running a step")

    def run_cache_ops(self, ops: list[CacheOp]) -> CacheOutcome:
        return self._call(("cache_ops", ops), "running cache operations")

    def num_forward_tokens(self) -> int:
        return self._call(("num_forward_tokens",), "reporting")

    def transfer_stats(self) -> dict:
        return self._call(("transfer_stats",), "reporting")

    def validate_guided(self, guided: GuidedDecoding) -> None:
        self._structured.validate(guided)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()
