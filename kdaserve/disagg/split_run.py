"""A prefill engine in a process of its own, the decode engine in this one, each optionally
pinned to its own CPUs (`kdaserve bench disagg --prefill-cpus 0 --decode-cpus 1`): the two
phases run at the same time, as two instances of a deployment do, instead of stepping in turn
in one thread (local.py). The cache moves over the connector's real loopback socket; the
prefill process reports each request's first token and when it came (time.perf_counter is
CLOCK_MONOTONIC, the same clock in both processes) over a pipe, and this process hands the
request to the decode engine as run_disaggregated does (local.hand_over)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import replace
from typing import Any

from kdaserve.disagg.local import Trace, counters_since, hand_over, take_deltas, transfer_counters
from kdaserve.disagg.params import KVTransferParams
from kdaserve.engine.core import EngineCore
from kdaserve.request import SamplingParams


def pin(cpus: set[int] | None) -> None:
    """This thread, and the threads it starts from now on, run on `cpus` only (None: as is);
    torch computes on as many threads as there are CPUs."""
    if cpus:
        import torch

        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))


def _prefill_main(conn, model: str, kwargs: dict[str, Any], peer: str,
                  cpus: set[int] | None) -> None:
    pin(cpus)
    from kdaserve.engine.llm import LLM

    eng = LLM(model, role="prefill", **kwargs).engine
    conn.send(("ready",))
    while (msg := conn.recv())[0] == "run":
        _, tids, prompts, params, helds = msg
        before = transfer_counters(eng)
        firsts: dict[str, list[int]] = {}
        for tid, p, held in zip(tids, prompts, helds):
            eng.add_request(tid, p, replace(params, max_tokens=1, kv_transfer=KVTransferParams(
                tid, peer=peer, held_tokens=held)))
        while eng.has_unfinished():
            for d in eng.step():
                firsts.setdefault(d.request_id, []).extend(d.new_token_ids)
                if d.finished:
                    conn.send(("first", d.request_id, firsts[d.request_id][:1],
                               time.perf_counter(), d.finish_reason, d.error))
        after = transfer_counters(eng)
        conn.send(("done", counters_since(before, after)))
    eng.transfer.connector.close()


class PrefillProcess:
    """The prefill engine's process: `run` one batch of prompts at a time."""

    def __init__(self, model: str, kwargs: dict[str, Any], peer: str,
                 cpus: set[int] | None = None, start_timeout_s: float = 600.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, args=(child, model, kwargs, peer, cpus),
                                daemon=True, name="kdaserve-prefill")
        self.proc.start()
        if not self.conn.poll(start_timeout_s) or self.conn.recv()[0] != "ready":
            self.close()
            raise RuntimeError("the prefill process did not start")

    def run(self, dec: EngineCore, prompts: list[list[int]], params: SamplingParams,
            hit_query: bool = True) -> tuple[list[Trace], dict[str, float]]:
        """All prompts at once: the traces (as run_disaggregated's) and the prefill side's
        transfer times and counters over the batch."""
        tids = [f"s{os.getpid()}-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        start = time.perf_counter()
        traces = {t: Trace(start=start) for t in tids}
        by_id = dict(zip(tids, prompts))
        # the hit query: what the decode engine holds of each prompt stays out of the transfer
        helds = [dec.hold_prefix(t, p) if hit_query else 0 for t, p in zip(tids, prompts)]
        self.conn.send(("run", tids, prompts, params, helds))
        done: dict[str, float] | None = None
        while done is None or dec.has_unfinished():
            # wait for the prefill side only while there is nothing to decode
            while self.conn.poll(0 if dec.has_unfinished() else 0.01):
                msg = self.conn.recv()
                if msg[0] == "done":
                    done = msg[1]
                    continue
                _, tid, first, at, reason, error = msg
                tr = traces[tid]
                tr.tokens, tr.times = list(first), [at] * len(first)
                hand_over(dec, tid, by_id[tid], params, tr, reason, error)
            if dec.has_unfinished():
                take_deltas(dec.step(), traces, skip_first=True)
            if not self.proc.is_alive():
                raise RuntimeError("the prefill process died")
        return list(traces.values()), done

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
