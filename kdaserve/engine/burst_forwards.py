"""The runner's half of multi-step decoding (engine/decode_burst.py says what a burst is and
when the scheduler plans one): the forwards after a burst's first, each feeding every row the
token it sampled last."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kdaserve.engine.cache_ops import StepOps
from kdaserve.outputs import ModelRunnerOutput

if TYPE_CHECKING:
    from kdaserve.engine.runner import ModelRunner
    from kdaserve.engine.step_plan import StepPlan


def run_burst(runner: ModelRunner, plan: StepPlan, result: ModelRunnerOutput,
              steps: int) -> None:
    """The burst's forwards after its first (`plan`, whose sampled tokens are in `result`):
    each feeds every row the token it sampled last. Appends to `result.sampled`. A burst
    never drafts: a sleeping drafter is told of each step's rows, as of a plain step's."""
    sampled = result.sampled
    no_ops = StepOps()
    # the fused decoder advances its row inputs in place; another forward plans each step
    fused = replace(plan, snapshots=[]) if plan.fused is not None else None
    proposer = runner.proposer
    for j in range(1, steps):
        last = [sampled[s.request_id][-1].token_id for s in plan.seqs]
        if fused is not None:       # the rows' requests suffice: the inputs advance in place
            step = fused
            if proposer is not None:
                # told here, with the rows' offset, rather than from rows rebuilt for it:
                # a dataclass copy per row and step cost ~1% of a batch-8 demo step
                proposer.missed(plan.seqs, j)
        else:
            rows = [replace(s, token_ids=[t], context_len=s.context_len + j)
                    for s, t in zip(plan.seqs, last)]
            step = runner.plan(rows, no_ops)
        fwd = runner.forward(step, False, advance=last if fused is not None else None)
        out = runner.finish(step, fwd, None, no_ops, None, False, propose=fused is None)
        for rid, toks in out.sampled.items():
            sampled[rid].extend(toks)
