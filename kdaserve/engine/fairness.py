"""Fairness between request groups (an HTTP request's prompts and n completions share one).

Waiting requests are admitted from the group with the fewest running sequences first, and when
every sequence slot is taken while a group waits with none running, the newest sequence of the
group holding the most slots is preempted (one per step), so one request with n=128 cannot
hold every slot while a short request waits. Plain Python over the scheduler's queues."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kdaserve.request import Request

if TYPE_CHECKING:
    from kdaserve.engine.scheduler import Scheduler


def next_waiting(waiting: Iterable[Request], counts: Counter, policy: str) -> Request:
    """FCFS (or priority) order, but a group with fewer running sequences goes first."""
    waiting = list(waiting)
    if policy == "priority":
        return min(waiting, key=lambda r: (counts[r.group], r.priority, r.arrival_time))
    head = waiting[0]
    if not counts[head.group]:
        return head
    return min(waiting, key=lambda r: counts[r.group])   # stable: FCFS among equals


def fair_share_victim(running: Sequence[Request], waiting: Iterable[Request],
                      max_num_seqs: int) -> Request | None:
    """When every sequence slot is taken and some waiting group has none running: the newest
    sequence of the group holding the most slots (if it holds at least two), so one request
    with n=128 cannot hold every slot while a short request waits."""
    waiting = list(waiting)
    if len(running) < max_num_seqs or not waiting:
        return None
    counts = Counter(r.group for r in running)
    if all(counts[r.group] for r in waiting):
        return None
    group, held = counts.most_common(1)[0]
    if held < 2:
        return None
    return next(r for r in reversed(running) if r.group == group)


def fair_share(sched: Scheduler) -> list[str]:
    """Preempt for a waiting group that has no running sequence: the victim's id, if any."""
    sched._fair_preempted = 0
    victim = fair_share_victim(sched.running, sched.waiting, sched.config.max_num_seqs)
    if victim is None:
        return []
    sched.running.remove(victim)
    sched._preempt(victim)
    sched.num_fair_preemptions += 1
    sched._fair_preempted = 1
    return [victim.request_id]
