"""One rank of a multi-rank engine, whoever started it: a process the engine spawned
(multiproc.py), a process `torchrun` started (torchrun.py) or a Ray actor (ray_executor.py).
It joins the process group, loads its share of the model, then runs the messages rank 0
broadcasts until told to stop. The code is the same for all three: `start_rank` sets a rank
up, `publish` hands rank 0's message to every rank, `handle` runs one message on one rank and
`follow` is the loop of every rank but 0. Only rank 0 answers the engine core (how depends on
the launcher: a pipe, an in-process call, a Ray method)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from kdaserve.config import EngineConfig
from kdaserve.ops.host_memory import freeze_startup_heap

logger = logging.getLogger("kdaserve")


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this worker when the engine process goes (no orphans even
    when the engine is SIGKILLed)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)           # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:              # the parent went before prctl took effect
        os._exit(1)


def build_worker_runner(config: EngineConfig, plan, ctx, local_rank: int | None = None):
    """`local_rank`: this rank's GPU on its node (torchrun's LOCAL_RANK; Ray shows each actor
    one GPU); by default the global rank modulo the node's GPUs."""
    from pathlib import Path

    from kdaserve.distributed.comm import union_failures
    from kdaserve.distributed.layout import rank_model_config
    from kdaserve.engine.offload_setup import worker_stores
    from kdaserve.engine.runner_builder import (
        build_runner,
        engine_chunk_size,
        has_tokenizer,
        prepare_model,
    )
    from kdaserve.tokenizer import Tokenizer

    device = torch.device(config.device)
    if device.type == "cuda":
        index = ctx.rank if local_rank is None else local_rank
        device = torch.device("cuda", index % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    model = prepare_model(config, device, parallel=ctx)
    tok = Tokenizer.from_pretrained(config.model) if has_tokenizer(Path(config.model)) else None
    rank_cfg = rank_model_config(model.config, ctx.tp_size)     # what the engine sized
    stores = worker_stores(config, rank_cfg, engine_chunk_size(config), device, ctx.rank,
                           ctx.world_size)
    runner = build_runner(config, plan, model, device, tok, stores=stores)
    if config.kv_transfer is not None:      # a tensor-parallel prefill or decode instance's rank
        from kdaserve.disagg.setup import attach_transfer

        attach_transfer(config, rank_cfg, runner, ctx.tp_size, ctx.tp_rank, ctx.control)
    if (stores or config.kv_transfer is not None) and ctx.world_size > 1:
        runner.cache_ops.set_agreement(union_failures)
    return runner


@dataclass
class RankState:
    """What one rank holds once started: its place in the layout and its runner."""

    ctx: Any                 # ParallelContext
    runner: Any              # ModelRunner
    config: EngineConfig     # rank 0's (every rank runs the engine's configuration)

    @property
    def data_parallel(self) -> bool:
        return self.config.parallel.data_parallel_size > 1


def start_rank(rank: int, world_size: int, init_method: str, config: EngineConfig,
               plan=None, local_rank: int | None = None) -> RankState:
    """Join the group, take rank 0's configuration and cache plan (a rank that torchrun
    started has no plan of its own), load this rank's share of the model."""
    from kdaserve.distributed.parallel_state import init_distributed

    par = config.parallel
    ctx = init_distributed(rank, world_size, par.tensor_parallel_size,
                           par.expert_parallel_size, init_method, config.device,
                           par.worker_timeout_s, par.data_parallel_size,
                           pp=par.pipeline_parallel_size)
    box = [(config, plan) if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0, group=ctx.control)
    config, plan = box[0]
    runner = build_worker_runner(config, plan, ctx, local_rank)
    dist.barrier()
    return RankState(ctx, runner, config)


def publish(ctx, msg: tuple | None = None) -> tuple:
    """Rank 0's message, on every rank (rank 0 passes it, the others receive it)."""
    if ctx.world_size == 1:
        return msg
    box = [msg]
    dist.broadcast_object_list(box, src=0, group=ctx.control)
    return box[0]


def handle(runner, msg: tuple, rank: int, world_size: int, data_parallel: bool) -> Any:
    """Run one message on this rank; what it returns matters on rank 0 only."""
    from kdaserve.distributed import pipeline
    from kdaserve.distributed.data_parallel import execute_step

    kind = msg[0]
    if kind == "ping":               # rank 0 checking, while idle, that every rank is there
        return None
    if kind == "execute" and data_parallel:
        return execute_step(runner, msg[1], rank, world_size)
    if kind == "execute" and pipeline.active():
        return pipeline.execute_step(runner, msg[1])
    if kind == "execute":
        return runner.execute(msg[1])
    if kind == "cache_ops":
        return runner.cache_ops.run(msg[1])
    if kind == "transfer_stats":
        return runner.cache_ops.stats
    if kind == "kv_transfer_stats":      # each rank sent its share of every request's cache
        from kdaserve.disagg.setup import rank_metrics

        mine = runner.cache_ops.transfer.metrics()
        every: list = [mine]
        if world_size > 1:
            every = [None] * world_size
            dist.all_gather_object(every, mine)
        return rank_metrics(every)
    if kind == "kv_transfer_address":    # rank 0's (a decode instance receives there)
        return runner.cache_ops.transfer.address
    if kind == "kv_transfer_drafts":     # in rank 0's inbox (the other ranks answer [])
        return runner.cache_ops.transfer.arrived_drafts(msg[1])
    if kind == "num_forward_tokens":
        result = runner.num_forward_tokens
        if data_parallel:            # each rank computed its own requests' tokens
            total = torch.tensor([result], dtype=torch.long)
            dist.all_reduce(total)
            result = int(total.item())
        return result
    raise ValueError(f"unknown worker message {kind!r}")


def run_on_rank(state: RankState, msg: tuple) -> Any:
    return handle(state.runner, msg, state.ctx.rank, state.ctx.world_size, state.data_parallel)


def follow(state: RankState) -> None:
    """Every rank but 0: run what rank 0 publishes until it says stop. A failure ends the
    process: the ranks may now disagree on which collective comes next."""
    while True:
        msg = publish(state.ctx)
        if msg[0] == "shutdown":
            return
        try:
            run_on_rank(state, msg)
        except Exception:           # noqa: BLE001
            logger.error("step failed:\n%s", traceback.format_exc())
            os._exit(1)


def worker_main(rank: int, world_size: int, init_method: str, config: EngineConfig, plan,
                conn: Connection, parent_pid: int, log_level: int) -> None:
    """A process the engine spawned (multiproc.py): rank 0 talks to the engine over `conn`."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the engine decides when workers stop
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    torch.set_num_threads(config.num_threads or 1)
    try:
        state = start_rank(rank, world_size, init_method, config, plan)
    except BaseException as exc:    # noqa: BLE001 - reported to the engine, then exit
        conn.send(("failed", f"rank {rank}: {type(exc).__name__}: {exc}"))
        logger.error("worker failed to start:\n%s", traceback.format_exc())
        os._exit(1)
    freeze_startup_heap()
    conn.send(("ready", rank))
    if rank == 0:
        _loop(state, conn)
    else:
        follow(state)
    conn.close()
    dist.destroy_process_group()


def _loop(state: RankState, conn: Connection) -> None:
    """Rank 0 of spawned workers: each message from the engine's pipe, published, run."""
    world_size = state.ctx.world_size
    while True:
        try:
            msg = conn.recv()
        except EOFError:             # the engine is gone
            msg = ("shutdown",)
        msg = publish(state.ctx, msg)
        if msg[0] == "shutdown":
            return
        try:
            result = run_on_rank(state, msg)
        except Exception as exc:        # noqa: BLE001
            logger.error("step failed:\n%s", traceback.format_exc())
            if world_size > 1:
                # the ranks may now disagree on which collective comes next: no rank can go on
                conn.send(("fatal", f"rank 0: {type(exc).__name__}: {exc}"))
                os._exit(1)
            conn.send(("error", exc))
            continue
        conn.send(("ok", result))
