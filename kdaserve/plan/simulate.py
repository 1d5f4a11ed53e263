"""`kdaserve plan --simulate`: a discrete-event simulation, over simulated time, of the engine's
own scheduler and cache manager serving a workload (kdaserve/plan/workload.py).

The loop is the engine core's (kdaserve/engine/core.py `step`): requests that arrived by now
are added, `Scheduler.schedule()` plans a step, the step is "run", `Scheduler.update()` takes
its result. Only the runner differs: no model and no tensors. Each scheduled request that
samples gets one deterministic token (the requests ignore EOS and stop at their output
length, as `kdaserve bench serve`'s do), every cache operation succeeds, and the step takes the
seconds its cost model charges for its shape (kdaserve/plan/step_cost.py). So batching,
chunking, prefix hits, snapshots, preemptions and offload traffic are the engine's decisions,
not a model of them.

Reported per request as `kdaserve bench serve` reports them (its `summarize`): TTFT is the end
of the step that produced the first output token less the arrival; TPOT the time from there to
the last token over the tokens after the first.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kdaserve.bench.serve import RequestResult, summarize
from kdaserve.cache.manager import CacheManager
from kdaserve.cache.offload import Offload
from kdaserve.cache.ops import LoadBlock, LoadState, StoreBlock, StoreSnapshot
from kdaserve.cache.planner import CachePlan
from kdaserve.cache.tiers import Tier
from kdaserve.config import CacheConfig, SchedulerConfig
from kdaserve.engine.scheduler import Scheduler
from kdaserve.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from kdaserve.plan.model import Plan, Roofline
from kdaserve.plan.step_cost import StepCost, StepShape
from kdaserve.plan.workload import Arrival
from kdaserve.request import Request, SamplingParams

FAKE_TOKEN = 1          # what every simulated step samples (EOS is ignored)


def fake_outputs(out: SchedulerOutput) -> ModelRunnerOutput:
    """The runner's answer without a model: one token for each request that samples."""
    return ModelRunnerOutput(sampled={s.request_id: [SampledToken(FAKE_TOKEN)]
                                      for s in out.sequences if s.sample})


@dataclass
class TierTraffic:
    """Bytes the step's offload operations move, per tier."""

    stored: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    loaded: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def count(self, out: SchedulerOutput, block_bytes: int, snapshot_bytes: int) -> None:
        for op in out.ops:
            if isinstance(op, (StoreBlock, StoreSnapshot)):
                n = block_bytes if isinstance(op, StoreBlock) else snapshot_bytes
                for tier in op.tiers:
                    self.stored[tier] += n
            elif isinstance(op, (LoadBlock, LoadState)):
                n = block_bytes if isinstance(op, LoadBlock) else snapshot_bytes
                self.loaded[op.tier] += n


@dataclass
class SimulationResult:
    summary: dict[str, Any]             # bench serve's keys (summarize), simulated
    steps: int
    preemptions: int
    prefix_hit_rate: float              # prompt tokens found in the cache / looked up
    prefix_hits: int                    # requests admitted with a hit
    snapshot_bytes_peak: int
    snapshots_taken: int
    offload_stored_bytes: dict[str, int]
    offload_loaded_bytes: dict[str, int]
    ended_unfinished: int               # too large for the cache: ended by the scheduler
    ttft_s: dict[str, float]            # per request id, for exact checks
    shapes: list[StepShape] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary, "steps": self.steps, "preemptions": self.preemptions,
                "prefix_hit_rate": self.prefix_hit_rate, "prefix_hits": self.prefix_hits,
                "snapshot_bytes_peak": self.snapshot_bytes_peak,
                "snapshots_taken": self.snapshots_taken,
                "offload_stored_bytes": dict(self.offload_stored_bytes),
                "offload_loaded_bytes": dict(self.offload_loaded_bytes),
                "ended_unfinished": self.ended_unfinished}


def simulate(workload: list[Arrival], plan: CachePlan, cache: CacheConfig,
             sched: SchedulerConfig, cost: StepCost,
             offload: Offload | None = None) -> SimulationResult:
    """Serve `workload` (sorted by arrival) with a fresh scheduler and cache manager."""
    manager = CacheManager.from_plan(plan, cache, offload=offload)
    scheduler = Scheduler(sched, manager)
    traffic = TierTraffic()
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    produced: dict[str, int] = defaultdict(int)
    shapes: list[StepShape] = []
    snap_peak = 0
    now, nxt = 0.0, 0
    while nxt < len(workload) or scheduler.has_unfinished():
        while nxt < len(workload) and workload[nxt].arrival_s <= now:
            a = workload[nxt]
            rid = f"r{nxt}"
            scheduler.add_request(Request(
                rid, list(a.prompt_token_ids),
                SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0),
                arrival_time=a.arrival_s))
            arrival[rid] = a.arrival_s
            nxt += 1
        if not scheduler.has_unfinished():
            now = workload[nxt].arrival_s           # idle until the next request
            continue
        out = scheduler.schedule()
        if out.is_empty:                 # nothing can run until something arrives
            scheduler.pop_ended()
            if nxt >= len(workload):
                break
            now = max(now, workload[nxt].arrival_s)
            continue
        shape = StepShape.of(out)
        shapes.append(shape)
        traffic.count(out, plan.block_bytes, plan.slot_bytes)
        now += cost.seconds(shape)
        for req in scheduler.update(out, fake_outputs(out)):
            rid = req.request_id
            produced[rid] = len(req.output_token_ids)
            first.setdefault(rid, now)
            if req.is_finished:
                done[rid] = now
        scheduler.pop_ended()
        snap_peak = max(snap_peak, manager.snapshots.bytes_held)
    results = []
    for rid, t0 in arrival.items():
        ok = rid in done
        results.append(RequestResult(
            ok=ok, prompt_tokens=0, output_tokens=produced.get(rid, 0),
            ttft_s=first.get(rid, t0) - t0, latency_s=done.get(rid, t0) - t0,
            error=None if ok else "ended by the scheduler (too large for the cache)"))
    for a, r in zip(workload, results):
        r.prompt_tokens = len(a.prompt_token_ids)
    start = workload[0].arrival_s if workload else 0.0
    stats = manager.stats
    summary = summarize(results, now - start)
    ok = [r for r in results if r.ok]
    for name, values in (("ttft", [r.ttft_s for r in ok]),
                         ("tpot", [t for r in ok if (t := r.tpot_s) is not None])):
        summary[f"p90_{name}_ms"] = float(np.percentile(values, 90)) * 1e3 if values else 0.0
    return SimulationResult(
        summary=summary, steps=len(shapes),
        preemptions=scheduler.num_preemptions,
        prefix_hit_rate=stats.hit_tokens / stats.query_tokens if stats.query_tokens else 0.0,
        prefix_hits=stats.hits, snapshot_bytes_peak=snap_peak,
        snapshots_taken=stats.snapshots_taken,
        offload_stored_bytes=dict(traffic.stored), offload_loaded_bytes=dict(traffic.loaded),
        ended_unfinished=sum(not r.ok for r in results),
        ttft_s={rid: first[rid] - t0 for rid, t0 in arrival.items() if rid in first},
        shapes=shapes)


def paper_cache(p: Plan, roof: Roofline, block_size: int, max_num_seqs: int,
                max_model_len: int, snapshot_share: float = 0.25) -> CachePlan:
    """One GPU's cache on a planned layout, as the engine would plan it (cache/planner.py
    `plan_cache`: a slot per sequence, `snapshot_share` of the memory for snapshots, the
    engine's default, the rest in MLA pages), from the plan's per-GPU bytes: a dp replica's
    scheduler sees one GPU's worth (its tp ranks hold the same requests)."""
    free = p.bytes_per_gpu["free_for_cache"]
    slot = max(int(roof.kda), 1)
    block = max(int(roof.mla * block_size), 1)
    snapshots = int(free * snapshot_share) // slot
    num_blocks = (free - (max_num_seqs + snapshots) * slot) // block
    if num_blocks < 1:
        raise ValueError(f"the layout leaves {free / 1e9:.1f} GB per GPU for the cache: not "
                         f"enough for {max_num_seqs} state slots and one MLA block; lower "
                         "--max-num-seqs or pick a larger layout")
    return CachePlan(int(num_blocks), block_size, max_num_seqs, snapshots, block, slot,
                     max_model_len)


def host_tier(capacity_bytes: int, plan: CachePlan) -> Offload:
    """An offload tier in host memory of `capacity_bytes` (what --offload-bytes buys)."""
    tier = Tier("host", capacity_bytes, plan.slot_bytes, plan.block_bytes // plan.block_size)
    return Offload([tier], plan.block_bytes, plan.slot_bytes)
