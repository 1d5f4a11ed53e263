"""One rank's process: joins the process group, loads its share of the model, then runs the
steps rank 0 broadcasts until told to stop. Only rank 0 talks to the engine core (a pipe);
the other ranks receive each message through torch.distributed (broadcast from rank 0)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from kdaserve.config import EngineConfig

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


def build_worker_runner(config: EngineConfig, plan, ctx):
    from kdaserve.engine.core import _has_tokenizer, build_proposer, engine_chunk_size
    from kdaserve.distributed.comm import union_failures
    from kdaserve.distributed.layout import rank_model_config
    from kdaserve.engine.offload_setup import worker_stores
    from kdaserve.engine.runner import ModelRunner
    from kdaserve.model.loader import load_model
    from kdaserve.structured.manager import StructuredOutputs
    from kdaserve.tokenizer import Tokenizer
    from pathlib import Path

    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", ctx.rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    model = load_model(config.model, dtype=config.dtype, device=str(device),
                       chunk_size=engine_chunk_size(config), progress=False, parallel=ctx,
                       moe_backend=config.parallel.moe_backend)
    model.fuse_for_inference()
    tok = Tokenizer.from_pretrained(config.model) if _has_tokenizer(Path(config.model)) else None
    rank_cfg = rank_model_config(model.config, ctx.tp_size)     # what the engine sized
    stores = worker_stores(config, rank_cfg, engine_chunk_size(config), device, ctx.rank,
                           ctx.world_size)
    runner = ModelRunner(model, plan, device, seed=config.seed,
                         proposer=build_proposer(config, model, device, plan), stores=stores,
                         structured=StructuredOutputs(tok, model.config.vocab_size))
    if stores and ctx.world_size > 1:
        runner.cache_ops.agree = union_failures
    return runner


def worker_main(rank: int, world_size: int, init_method: str, config: EngineConfig, plan,
                conn: Connection, parent_pid: int, log_level: int) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the engine decides when workers stop
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    torch.set_num_threads(config.num_threads or 1)
    par = config.parallel
    try:
        from kdaserve.distributed.parallel_state import init_distributed

        ctx = init_distributed(rank, world_size, par.tensor_parallel_size,
                               par.expert_parallel_size, init_method, config.device,
                               par.worker_timeout_s, par.data_parallel_size,
                               pp=par.pipeline_parallel_size)
        runner = build_worker_runner(config, plan, ctx)
        dist.barrier()
    except BaseException as exc:    # noqa: BLE001 - reported to the engine, then exit
        conn.send(("failed", f"rank {rank}: {type(exc).__name__}: {exc}"))
        logger.error("worker failed to start:\n%s", traceback.format_exc())
        os._exit(1)
    conn.send(("ready", rank))
    _loop(rank, world_size, runner, conn, par.data_parallel_size > 1)
    conn.close()
    dist.destroy_process_group()


def _loop(rank: int, world_size: int, runner, conn: Connection, data_parallel: bool) -> None:
    from kdaserve.distributed import pipeline
    from kdaserve.distributed.data_parallel import execute_step

    while True:
        msg = None
        if rank == 0:
            try:
                msg = conn.recv()
            except EOFError:             # the engine is gone
                msg = ("shutdown",)
        if world_size > 1:
            box = [msg]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
        kind = msg[0]
        if kind == "shutdown":
            return
        try:
            if kind == "execute" and data_parallel:
                result = execute_step(runner, msg[1], rank, world_size)
            elif kind == "execute" and pipeline.active():
                result = pipeline.execute_step(runner, msg[1])
            elif kind == "execute":
                result = runner.execute(msg[1])
            elif kind == "cache_ops":
                result = runner.cache_ops.run(msg[1])
            elif kind == "transfer_stats":
                result = runner.cache_ops.stats
            elif kind == "num_forward_tokens":
                result = runner.num_forward_tokens
                if data_parallel:            # each rank computed its own requests' tokens
                    total = torch.tensor([result], dtype=torch.long)
                    dist.all_reduce(total)
                    result = int(total.item())
            else:
                raise ValueError(f"unknown worker message {kind!r}")
        except Exception as exc:        # noqa: BLE001
            logger.error("step failed:\n%s", traceback.format_exc())
            if world_size > 1:
                # the ranks may now disagree on which collective comes next: no rank can go on
                if rank == 0:
                    conn.send(("fatal", f"rank {rank}: {type(exc).__name__}: {exc}"))
                os._exit(1)
            conn.send(("error", exc))
            continue
        if rank == 0:
            conn.send(("ok", result))
