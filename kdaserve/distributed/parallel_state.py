"""The process groups of one engine, built once per worker process.

Every rank of a layout is both a tensor-parallel rank (attention heads, MLP widths and the
vocabulary sharded tp ways) and an expert-parallel rank (routed experts partitioned ep ways);
ParallelConfig keeps tp and ep equal or one of them 1, so one group serves both. Pipeline
parallelism runs alone (tp = ep = dp = 1): rank r is stage r. gloo runs on
CPU (CI, this machine), NCCL on CUDA: the code path is the same.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    tp_size: int
    ep_size: int
    group: object | None = None          # the ranks' process group (None: the default group)
    dp_size: int = 1                     # >1: each rank holds its own tokens (attention DP)
    pp_size: int = 1                     # >1: rank r is pipeline stage r (its layers only)
    # the step messages rank 0 broadcasts (gloo, also under NCCL: they are Python objects).
    # Its timeout is long: the other ranks wait here for as long as the engine idles, while
    # the model's collectives keep the worker timeout, so a dead rank still fails them fast.
    control: object | None = None

    @property
    def tp_rank(self) -> int:
        return self.rank if self.tp_size > 1 else 0

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep_size > 1 else 0

    @property
    def pp_rank(self) -> int:
        return self.rank if self.pp_size > 1 else 0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


_CONTEXT: ParallelContext | None = None
CONTROL_TIMEOUT = datetime.timedelta(days=365)


def init_distributed(rank: int, world_size: int, tp: int, ep: int, init_method: str,
                     device: str = "cpu", timeout_s: float = 300.0,
                     dp: int = 1, pp: int = 1) -> ParallelContext:
    global _CONTEXT
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    control = None
    if world_size > 1:
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _CONTEXT = ParallelContext(rank, world_size, tp, ep, dp_size=dp, control=control,
                               pp_size=pp)
    return _CONTEXT


def get_context() -> ParallelContext | None:
    return _CONTEXT


def destroy_distributed() -> None:
    global _CONTEXT
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTEXT = None
