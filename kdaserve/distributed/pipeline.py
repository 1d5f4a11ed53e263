"""Pipeline-parallel steps: rank s is stage s and holds layers stage_layers(s) (and their
caches only; kdaserve/distributed/pipeline_model.py).

Every rank receives the whole step message (the worker loop broadcasts it) and builds the same
micro-batches from it: the step's sequences split into up to P groups balanced by tokens, each
with its own forward layout. Stage s posts its receives for all micro-batches at once, then runs
micro-batch m as soon as its carry (hidden states, and K3's bank of block sums) arrives from
stage s-1, and sends its own carry on without waiting (isend), so stage s works on m+1 while
stage s+1 works on m. The last stage samples (verifies drafts, proposes n-gram drafts) each
micro-batch; its merged result is then broadcast: rank 0 hands it to the engine, and the other
stages commit their KDA states after each verify row's last accepted draft (speculative
decoding), which only the last stage's sampling decides.

The scheduler is untouched: one logical cache, the same block ids and state slots on every
stage. Steps do not overlap (the scheduler needs a step's tokens to plan the next), so the
micro-batches fill the pipeline within a step only.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from kdaserve.distributed.data_parallel import merge
from kdaserve.distributed.parallel_state import get_context
from kdaserve.distributed.pipeline_model import Carry, run_stage, stage_of
from kdaserve.engine.encoder_cache import embed_with_media
from kdaserve.engine.runner import ForwardResult
from kdaserve.model.kept_states import ForwardKept
from kdaserve.outputs import ModelRunnerOutput, SchedulerOutput

_TAGS = 3           # tensors in one carry at most (hidden, bank, bank inverse RMS)


def active() -> bool:
    """Whether this process is a pipeline stage (the worker loop's dispatch)."""
    ctx = get_context()
    return ctx is not None and ctx.pp_size > 1


def micro_batches(out: SchedulerOutput, n: int) -> list[SchedulerOutput]:
    """Up to n parts of the step, each a set of whole sequences (the plan of each takes its
    own rows' snapshots from the step's operations), balanced by tokens (longest first, each to
    the lightest part). Deterministic: every stage
    computes the same split from the same message."""
    seqs = out.sequences
    parts: list[list] = [[] for _ in range(min(n, len(seqs)))]
    load = [0] * len(parts)
    for s in sorted(seqs, key=lambda s: -len(s.token_ids)):
        i = load.index(min(load))
        parts[i].append(s)
        load[i] += len(s.token_ids)
    return [replace(out, sequences=part) for part in parts]


@torch.inference_mode()
def execute_step(runner, out: SchedulerOutput) -> ModelRunnerOutput | None:
    """One step on this stage; rank 0 returns the step's result (the others None)."""
    ctx = get_context()
    model, device = runner.model, runner.device
    stage = stage_of(model, ctx)
    ops = runner.begin(out)
    steps = [runner.plan(p.sequences, ops, persistent=False)
             for p in micro_batches(out, stage.size)]
    steps = [s for s in steps if s is not None]
    if any(s.fb is None for s in steps):
        raise RuntimeError("a pipeline stage cannot take the fused decode path")
    # every receive posted up front: micro-batch m runs as soon as its carry is in
    inbox = []
    if not stage.first:
        for m, st in enumerate(steps):
            carry = Carry.empty(model, stage, len(st.ids), device)
            inbox.append((carry, [dist.irecv(t, src=ctx.rank - 1, tag=m * _TAGS + k)
                                  for k, t in enumerate(carry.tensors())]))
    sends, results = [], []
    for m, st in enumerate(steps):
        masks = runner.start_masks(st) if stage.last else None
        carry = None
        if inbox:
            carry, works = inbox[m]
            for w in works:
                w.wait()
        embeds = None
        if stage.first and any(s.media for s in st.seqs):   # the tower runs on stage 0 only
            embeds = embed_with_media(model, st.ids, st.seqs, st.starts, runner.encoder_cache)
        y = run_stage(model, stage, st.ids, st.fb, carry, embeds)
        if stage.last:
            fwd = ForwardResult(y, [], st.fb.positions, st.fb.mla.slot_mapping,
                                ForwardKept(st.fb) if st.fb.decode is not None else None)
            results.append(runner.finish(st, fwd, masks, ops, out.draft_limits, out.drafting))
        else:
            sends += [dist.isend(t, dst=ctx.rank + 1, tag=m * _TAGS + k)
                      for k, t in enumerate(y.tensors())]
    for w in sends:
        w.wait()
    box = [merge(results) if stage.last else None]
    dist.broadcast_object_list(box, src=stage.size - 1)
    result: ModelRunnerOutput = box[0]
    if not stage.last:
        for st in steps:          # commit each verify row's state after its accepted drafts
            runner.settle(st, ops, ForwardKept(st.fb) if st.fb.decode is not None else None,
                          result.sampled)
    if ctx.rank != 0:
        return None
    result.cache = ops.outcome    # rank 0 settled as the last stage did: the same drops
    return result
