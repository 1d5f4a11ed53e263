"""Run a function on N gloo ranks on this machine (benchmarks and tests of collectives):
spawned processes, a deadline, and every process gone when it returns."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.multiprocessing as tmp

from kdaserve.distributed.parallel_state import destroy_distributed, init_distributed


def _entry(rank: int, fn: Callable, world: int, tp: int, ep: int, dp: int, init_method: str,
           args: tuple) -> None:
    import torch

    torch.set_num_threads(1)
    ctx = init_distributed(rank, world, tp, ep, init_method, timeout_s=120.0, dp=dp)
    try:
        fn(ctx, *args)
    finally:
        destroy_distributed()


def run_ranks(fn: Callable, world: int, args: tuple = (), tp: int = 1, ep: int = 1,
              timeout_s: float = 300.0, dp: int = 1) -> None:
    """fn(ctx, *args) on `world` ranks; raises if one fails or the deadline passes."""
    from kdaserve.engine.executor.multiproc import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    pc = tmp.start_processes(_entry, args=(fn, world, tp, ep, dp, init, args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not pc.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout_s:.0f} s")
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.kill()
            p.join(2.0)
