"""What a finished step teaches the engine, before its results reach the requests
(EngineCore._finish): the step's cost for adaptive speculation (engine/spec/adaptive.py), the
decode guard (engine/decode_guard.py) and multi-step bursts (engine/decode_burst.py), and the
engine's counters (steps, preemptions, prompt tokens, time drafting, verifying and dormant)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdaserve.outputs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kdaserve.engine.core import EngineCore


def observe(core: EngineCore, out: SchedulerOutput, result: ModelRunnerOutput,
            seconds: float) -> None:
    """`seconds`: the step's wall time (a burst's whole)."""
    requests = core.scheduler.requests
    policy = core.scheduler.spec_policy
    # what one of a burst's forwards took (engine/decode_burst.py); token rates take the
    # whole burst's time
    step_seconds = seconds / out.num_steps
    if policy is not None and not out.is_empty:   # what steps cost: the policy's data
        verifies = any(s.num_draft_tokens for s in out.sequences)
        policy.cost.observe(out.num_tokens, len(result.drafts), step_seconds,
                            verifies=verifies)
        if all(len(s.token_ids) == 1 + s.num_draft_tokens for s in out.sequences):
            policy.realized.observe(len(out.sequences), verifies,
                                    sum(len(t) for t in result.sampled.values()), seconds,
                                    asleep=not out.drafting)
    if core.config.speculative is not None and not out.is_empty:
        _spec_time(core, out, result, seconds)
    if (core.scheduler.max_burst > 1 and not out.is_empty      # read by bursts alone
            and all(s.is_decode for s in out.sequences)):
        core.scheduler.decode_seconds = step_seconds
    if core.scheduler.guard is not None:
        core.scheduler.guard.observe_step(out, step_seconds)
    core.stats.steps += out.num_steps
    core.stats.preemptions += len(out.preempted)
    for seq in out.sequences:
        req = requests.get(seq.request_id)
        if req is not None and seq.context_len < req.num_prompt_tokens:
            core.stats.prompt_tokens += min(len(seq.token_ids),
                                            req.num_prompt_tokens - seq.context_len)


def _spec_time(core: EngineCore, out: SchedulerOutput, result: ModelRunnerOutput,
               seconds: float) -> None:
    st = core.stats
    st.spec_draft_seconds += result.draft_seconds
    if not out.drafting:
        st.spec_dormant_seconds += seconds
    elif any(s.num_draft_tokens for s in out.sequences):
        st.spec_verify_seconds += max(0.0, seconds - result.draft_seconds)
