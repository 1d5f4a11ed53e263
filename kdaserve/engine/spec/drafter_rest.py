"""When the drafter sleeps and when it wakes (adaptive speculation's rest cycle).

An idle drafter still costs (capture, projection, the proposer), so after `sleep_after` plans
in a row in which no request earned a draft, and once `sleep_trials` blocks were verified
since it woke, the drafter sleeps (`dormant`): nothing is captured, projected, proposed or
probed. Those trials are owed (`owed`): at the start and after each wake the policy gives them
at once to requests with no acceptance of their own, outside its probe budget. It wakes when
a request is admitted after `wake_after` steps asleep (to notice text that changed), or at
another batch-size bucket not woken for `wake_after` steps if the admitted request's kind's
acceptance would pay there (a bucket changes what a verifying step costs, not what the
drafts are worth). Each wake that finds nothing worth drafting doubles the wait (up to
`max_wake_after`), and a sleep at a batch size where the acceptance shown could not pay
waits `max_wake_after`. A wake costs about `sleep_after` awake plans and `sleep_trials` probe
blocks. A nap (`nap`) is a sleep the policy starts to time the asleep engine, which ends when
that is done: as a sleep where speculation loses, else awake.

Counts only: the policy (adaptive.py) says what each plan earned and who was admitted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class RestSettings(Protocol):
    """The policy's settings (AdaptiveSpeculation's fields), read where they are used."""

    # plans in a row without an earned draft before a sleep (None: never). Once the
    # `sleep_trials` blocks are in, a plan's choice changes only with new evidence, which only
    # budgeted probes bring: more plans would be capture and projection for nothing
    sleep_after: int | None
    wake_after: int                # steps asleep before an admission wakes the drafter
    sleep_trials: int              # verified blocks since waking, at least, before a sleep
    max_wake_after: int


class DrafterRest:
    def __init__(self, settings: RestSettings) -> None:
        self.settings = settings
        self.dormant = False              # the drafter sleeps: no capture, proposals, probes
        self.sleeps = 0
        self.streak = 0                   # plans in a row in which nobody earned a draft
        self.trials_since_wake = 0        # verified blocks: the evidence a sleep rests on
        self.fresh: set[str] = set()      # admitted since the last wake (or the start)
        self.owed = settings.sleep_trials  # probes due at once: the evidence for the next sleep
        self._asleep = 0                  # steps since the drafter fell asleep
        self._sleep_bucket = 0
        self._wait = settings.wake_after
        self._earned_since_wake = True    # the first sleep waits wake_after
        self._bucket_woken: dict[int, int] = {}   # batch-size bucket -> step of its last wake
        self.napping = False              # a nap (nap()): asleep to time the asleep steps
        self._nap_left = 0                # steps the nap may still take
        self.nap_rows = 0                 # the batch size it times

    @property
    def stuck(self) -> bool:
        """Enough plans in a row earned nothing for a sleep, evidence permitting."""
        after = self.settings.sleep_after
        return after is not None and self.streak >= after

    def slept(self, steps: int) -> None:
        self._asleep += steps
        self._nap_left -= steps if self.napping else 0

    def note_earned(self, earned: bool, rows: int, probing: bool, vetoed: bool = False
                    ) -> None:
        """A plan over `rows` requests gave some request a draft it earned, or none did.
        `vetoed`: the realized rates say verifying loses at this batch size. No number of
        plans changes that, only verifying steps do, so such a drafter sleeps as soon as its
        trials are in, not after `sleep_after` plans: those awake plans (one forward a step,
        states captured) made up most of a wake's cost, ~9% of the 128-token request a K3
        demo wake fell in."""
        if earned:
            self.streak, self._earned_since_wake = 0, True
            return
        self.streak += 1
        cfg = self.settings
        if vetoed and cfg.sleep_after is not None:
            self.streak = max(self.streak, cfg.sleep_after)
        # asleep only on evidence: a few verified blocks (probes count) since waking, else a
        # drafter whose first trials have not come yet would never get them
        if self.stuck and not probing and self.trials_since_wake >= cfg.sleep_trials:
            self._asleep, self._sleep_bucket = 0, max(1, rows).bit_length()
            # a wake that found nothing: wait longer before the next
            self._fall_asleep(cfg.wake_after if self._earned_since_wake
                              else min(2 * self._wait, cfg.max_wake_after))

    def _fall_asleep(self, wait: int) -> None:
        """Sleep until an admission after `wait` steps asleep (or a bucket change) wakes it."""
        self.dormant, self.streak, self.trials_since_wake = True, 0, 0
        self.sleeps += 1
        self._wait, self._earned_since_wake = wait, False

    def admitted(self, rows: int, request_id: str | None, step: int,
                 would_pay: Callable[[], bool], hopeless: Callable[[], bool] = bool
                 ) -> None:
        """A request was admitted into a batch of `rows` at plan `step`: wake if the drafter
        slept long enough, or the batch moved to a bucket where `would_pay()` says drafting
        could pay. Where `hopeless()` (the acceptance measured could not pay at this batch
        size) the wait is `max_wake_after`: the Kimi Linear demo's wakes took 20-26% of the
        128-token requests they fell in."""
        if not self.dormant:
            if request_id is not None:
                self.fresh.add(request_id)
            return
        bucket, wake_after = max(1, rows).bit_length(), self.settings.wake_after
        moved = (bucket != self._sleep_bucket
                 and step - self._bucket_woken.get(bucket, -wake_after) >= wake_after
                 and would_pay())
        wait = wake_after if self.napping else self._wait
        if self._asleep >= wait and wait < self.settings.max_wake_after and hopeless():
            wait = self.settings.max_wake_after
        if self._asleep >= wait or moved:
            self.dormant, self.streak = False, 0
            self.napping, self._nap_left = False, 0
            self._bucket_woken[bucket] = step
            # the probes the next sleep rests on come at once, outside the budget: a woken
            # drafter waiting for probe_share to earn them stays awake (capturing, proposing:
            # ~15% of a fused CPU step) for hundreds of steps
            self.owed = self.settings.sleep_trials
            self.fresh = {request_id} if request_id is not None else set()

    def nap(self, steps: int, rows: int) -> None:
        """Sleep for at most `steps` steps so that the asleep engine's rate gets measured:
        verifying steps can only be judged against it (step_cost.RealizedRates), and a
        drafter whose drafts the cost model says pay would never sleep on its own. Ended by
        end_nap; an admission meanwhile wakes it as it would wake a sleep."""
        self.dormant, self.napping, self._nap_left = True, True, max(1, steps)
        self.nap_rows, self._asleep, self._sleep_bucket = rows, 0, max(1, rows).bit_length()

    @property
    def nap_over(self) -> bool:
        return self.napping and self._nap_left <= 0

    def end_nap(self, sleep_on: bool) -> None:
        """The nap's measurement is in (or its steps ran out). `sleep_on` (speculation
        loses, or was not measured): the nap becomes a sleep, as if the drafter had dozed off
        on its own; else it wakes with the evidence it had (no probes owed)."""
        self.napping, self._nap_left = False, 0
        if sleep_on:                 # (asleep since the nap began, at its batch size)
            self._fall_asleep(self.settings.wake_after)
        else:
            self.dormant, self.streak, self.owed = False, 0, 0
