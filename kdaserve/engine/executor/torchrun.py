"""Ranks that `torchrun` started (docs/parallelism.md, "Launching with torchrun").

Every rank runs the same command. Rank 0 runs the engine core (scheduler, server) with a
`TorchrunExecutor`: it holds rank 0's runner in its own process and publishes each message to
the other ranks. Every other rank runs only `run_torchrun_rank` (no server, no scheduler) and
exits when rank 0 shuts down. The group joins through env:// (MASTER_ADDR, MASTER_PORT; under
torchrun, the agent's store). A rank that dies fails rank 0's next collective: at once when
its connections close, else when the worker timeout (the gloo timeout) passes; torchrun's
agent also ends the other ranks when one fails (on its node; rank 0 may be on another).

The other ranks are not rank 0's children, so rank 0 cannot watch their exit as the spawned
and Ray backends do. While idle it pings them instead (`check_alive`, every heartbeat): a
"ping" message through the control group, which fails as a step would once a rank's
connections closed, so a rank that dies between requests turns /health 503.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kdaserve.config import ConfigError, EngineConfig, ParallelConfig
from kdaserve.engine.executor.base import ExecutorError, RankExecutor
from kdaserve.engine.executor.worker import follow, publish, run_on_rank, start_rank

if TYPE_CHECKING:  # for annotations only: importing an executor loads no llguidance
    from kdaserve.structured.manager import StructuredOutputs

logger = logging.getLogger("kdaserve")

_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def torchrun_env() -> TorchrunEnv | None:
    """What torchrun put in the environment; None when it did not start this process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    missing = [v for v in _VARS if v not in os.environ]
    if missing:
        raise ConfigError(f"RANK and WORLD_SIZE are set but not {', '.join(missing)}: start "
                          "the ranks with torchrun (or set all of " + ", ".join(_VARS) + ")")
    e = os.environ
    return TorchrunEnv(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e["LOCAL_RANK"]),
                       e["MASTER_ADDR"], int(e["MASTER_PORT"]))


def require_torchrun(par: ParallelConfig) -> TorchrunEnv:
    """The ranks torchrun started, checked against the layout (on every rank, before any
    rank joins the group: a mismatch is a clear error, not a rendezvous that never ends)."""
    env = torchrun_env()
    if env is None:
        raise ConfigError("--distributed-executor torchrun: this process was not started by "
                          "torchrun (RANK and WORLD_SIZE are not set)")
    if env.world_size != par.world_size:
        raise ConfigError(
            f"torchrun started {env.world_size} ranks but the layout needs {par.world_size} "
            f"(--tensor-parallel-size {par.tensor_parallel_size}, --expert-parallel-size "
            f"{par.expert_parallel_size}, --data-parallel-size {par.data_parallel_size}); "
            f"run torchrun with {par.world_size} processes in all (--nproc-per-node x --nnodes)")
    return env


def is_torchrun_worker(par: ParallelConfig) -> bool:
    """A rank > 0 under torchrun: it runs the worker loop only."""
    if par.executor != "torchrun":
        return False
    return require_torchrun(par).rank > 0


def run_torchrun_rank(config: EngineConfig) -> int:
    """A rank > 0: join, load this rank's share, run what rank 0 publishes until it stops.
    Returns the process exit code."""
    import torch

    from kdaserve.distributed.parallel_state import destroy_distributed

    env = require_torchrun(config.parallel)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    state = start_rank(env.rank, env.world_size, "env://", config, None, env.local_rank)
    logger.info("kdaserve: torchrun rank %d of %d ready", env.rank, env.world_size)
    try:
        follow(state)
    except RuntimeError as exc:          # rank 0 is gone: its connections closed
        logger.error("rank %d lost rank 0: %s", env.rank, exc)
        # leave without the interpreter's teardown: the broken process group's destructors
        # can abort it (gloo: "terminate called without an active exception", exit -6
        # instead of 1, seen once in tests/distributed/test_torchrun.py)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    destroy_distributed()
    return 0


def _stop(ctx) -> None:
    from kdaserve.distributed.parallel_state import destroy_distributed

    try:
        publish(ctx, ("shutdown",))
    except RuntimeError:
        pass                          # a rank is gone already
    destroy_distributed()


class TorchrunExecutor(RankExecutor):
    """Rank 0 under torchrun: its runner in the engine core's process."""

    def __init__(self, config: EngineConfig, plan, structured: StructuredOutputs) -> None:
        from kdaserve.distributed.parallel_state import destroy_distributed

        env = require_torchrun(config.parallel)
        if env.rank != 0:
            raise ConfigError("under torchrun only rank 0 runs the engine core")
        self._init_ranks(config, structured)
        self.world_size = env.world_size
        try:
            self._state = start_rank(0, env.world_size, "env://", config, plan, env.local_rank)
        except Exception as exc:       # noqa: BLE001 - any failure to start is fatal here
            destroy_distributed()
            raise ExecutorError(f"rank 0 could not start with the other torchrun ranks "
                                f"({env.master_addr}:{env.master_port}): "
                                f"{type(exc).__name__}: {exc}") from None
        # at exit too (a script that never calls shutdown): the other ranks stop with us
        self._finalizer = weakref.finalize(self, _stop, self._state.ctx)
        logger.info("kdaserve: torchrun rank 0 of %d ready", env.world_size)

    def check_alive(self) -> None:
        if self._closed:
            return
        try:                        # a dead rank fails the ping's broadcast
            self._call(("ping",), "pinging the other ranks")
        except ExecutorError as exc:
            raise ExecutorError(f"a worker died while the engine was idle: {exc}") from None

    def _call(self, msg: tuple, doing: str):
        if self._closed:
            raise ExecutorError("the executor is shut down")
        try:
            publish(self._state.ctx, msg)
            return run_on_rank(self._state, msg)
        except Exception as exc:       # noqa: BLE001 - with several ranks every failure is fatal
            # the ranks may disagree on the next collective: none can go on. Our exit closes
            # the connections, which ends the other ranks (and torchrun's agent ends them).
            self._closed = True
            self._finalizer.detach()
            raise ExecutorError(f"torchrun rank 0 failed while {doing}: "
                                f"{type(exc).__name__}: {exc} (a rank that died or hangs "
                                "fails rank 0's collectives; see the other ranks' logs)"
                                ) from None

