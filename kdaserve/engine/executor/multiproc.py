"""One worker process per rank (torch.multiprocessing spawn). The engine core sends each step
to rank 0 over a pipe; rank 0 broadcasts it to the other ranks through torch.distributed and
answers with its `ModelRunnerOutput`. Every wait on a worker also watches all workers' exit
sentinels, so a worker that dies ends the engine with a clear error in bounded time."""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

import torch.multiprocessing as tmp

from kdaserve.config import EngineConfig
from kdaserve.engine.executor import spawn_errors
from kdaserve.engine.executor.base import ExecutorError, RankExecutor
from kdaserve.engine.executor.worker import worker_main

if TYPE_CHECKING:  # for annotations only: importing an executor loads no llguidance
    from kdaserve.structured.manager import StructuredOutputs

logger = logging.getLogger("kdaserve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list, conns: list[Connection], grace_s: float = 5.0) -> None:
    """Ask rank 0 to stop everyone, then terminate, then kill whatever is left. A group with a
    dead rank is killed at once: rank 0 would wait for it in the shutdown broadcast, and the
    workers ignore SIGTERM when the engine process does (the disposition is inherited)."""
    if not any(p.exitcode is not None for p in procs):
        try:
            if procs and procs[0].is_alive():
                conns[0].send(("shutdown",))
        except (OSError, BrokenPipeError, ValueError):
            pass
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for c in conns:
        c.close()


class MultiprocExecutor(RankExecutor):
    def __init__(self, config: EngineConfig, plan, structured: StructuredOutputs,
                 startup_timeout_s: float = 900.0) -> None:
        self._init_ranks(config, structured)
        par = config.parallel
        self.timeout_s = par.worker_timeout_s
        ctx = tmp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs, self.conns = [], []
        level = logging.getLogger("kdaserve").getEffectiveLevel()
        with spawn_errors.error_file() as errors:
            for rank in range(self.world_size):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=worker_main, name=f"kdaserve-worker-{rank}", daemon=True,
                                args=(rank, self.world_size, init_method, config, plan, theirs,
                                      os.getpid(), level))
                try:
                    p.start()
                except RuntimeError as exc:
                    if spawn_errors.bootstrapping():     # we are a worker: see spawn_errors
                        raise spawn_errors.report_from_worker(exc) from exc
                    raise
                theirs.close()
                self.procs.append(p)
                self.conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        try:
            for rank in range(self.world_size):
                try:
                    kind, detail = self._recv(rank, startup_timeout_s, "starting")
                except ExecutorError as exc:
                    raise ExecutorError(f"{exc}{spawn_errors.explain(errors)}") from None
                if kind != "ready":
                    raise ExecutorError(f"a worker failed to start: {detail}")
        except BaseException:
            self.shutdown()
            raise
        finally:
            errors.unlink(missing_ok=True)
        logger.info("kdaserve: %d worker processes ready (pids %s)", self.world_size,
                    [p.pid for p in self.procs])

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check_alive(self) -> None:
        why = self._dead()
        if why is not None and not self._closed:
            raise ExecutorError(f"a worker died while the engine was idle: {why}")

    def _dead(self) -> str | None:
        gone = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
        if not gone:
            return None
        return ", ".join(f"rank {r} exited with code {c}" for r, c in gone)

    def _recv(self, rank: int, timeout_s: float, doing: str):
        if self._closed:
            raise ExecutorError("the executor is shut down")
        conn = self.conns[rank]
        deadline = time.monotonic() + timeout_s
        sentinels = [p.sentinel for p in self.procs]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.shutdown()
                raise ExecutorError(f"worker rank {rank} did not answer within {timeout_s:.0f} s "
                                    f"while {doing}")
            ready = wait([conn, *sentinels], timeout=min(left, 1.0))
            if conn in ready:
                try:
                    return conn.recv()
                except EOFError:
                    pass          # it died: the sentinels say how
            if ready:
                time.sleep(0.05)   # let the exit code settle
                dead = self._dead()
                if dead is not None:
                    self.shutdown()
                    raise ExecutorError(f"a worker process died while {doing}: {dead}")

    def _call(self, msg: tuple, doing: str):
        if self._closed:
            raise ExecutorError("the executor is shut down")
        dead = self._dead()
        if dead is not None:
            self.shutdown()
            raise ExecutorError(f"a worker process died: {dead}")
        try:
            self.conns[0].send(msg)
        except (BrokenPipeError, OSError) as exc:
            self.shutdown()
            raise ExecutorError(f"cannot reach worker rank 0 ({exc})") from None
        kind, value = self._recv(0, self.timeout_s, doing)
        if kind == "ok":
            return value
        if kind == "error":        # one rank alone: the step failed, the worker goes on
            raise value
        self.shutdown()
        raise ExecutorError(f"a worker failed while {doing}: {value}")

