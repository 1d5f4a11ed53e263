"""Decode latency guard: how much of a long prompt a step may carry while other requests wait
on that step for their next token.

Chunked prefill alone does not protect decoding: on two CPU cores a 512-token chunk costs
~100 ms against ~5 ms for a decode step, so a short request that decodes beside one long prompt
(or beside an echo request scoring 16 long prompts) takes each of its tokens at the chunk's pace,
20x its unloaded latency. vLLM accepts that; issue 35's bar (every concurrent normal request
within 3x its unloaded latency) does not.

So while steps carry latency-sensitive work (decoding sequences, or short prompts that finish
in the step), the bulk prefill in them (chunks of prompts of more than `bulk_tokens` tokens, less
their prefix hits) is
paid from a credit: each such step earns (s - 1) times its cost without bulk, and a chunk spends
what it adds to its step. What a waiting request meets is the sum of its steps, so over any run
of steps they cost at most `max_slowdown` = s times what they would without the bulk. The costs
are the engine's measured ones (StepCostModel, fit online on this machine's steps):

    seconds = a + b·prefill_tokens + c·sensitive_rows + d·[the step has prefill]

A step without bulk is timed directly (a moving average of the decode-only steps), and a chunk
of P tokens spends what the fit predicts for its step less that. On CPU d is large (a step with
any prefill leaves the fused single-token decode kernels), so chunks come every few steps
rather than a few tokens each;
nothing below `min_chunk` tokens is worth a step of its own. The credit is capped at
`window` steps' worth, so a long quiet stretch does not buy one huge chunk. A long prompt always
advances (the credit grows with every sensitive step), and with nothing sensitive in the step
it takes the whole budget as before. On a GPU, where a chunk costs little more than a decode
step, the same rule leaves chunks whole. Plain Python: the scheduler owns it.

A request that arrives while a step runs waits for that step first. So while the server is
serving latency-sensitive work (any within the last `recent_seconds` of step time), a step of
bulk alone is cut to what the fit says takes `arrival_seconds` (50 ms; a decode burst's
BURST_SECONDS for prefill): on two CPU cores a 512-token scoring step of the K3 demo takes
80-160 ms against 56-95 ms for a whole 16-token request unloaded. Never below the tokens that
cost `fixed_multiple` times the step's fixed cost: where that cost alone nears 50 ms (a
model read from memory), a smaller chunk would pay it again and again for nothing. Until a
step of at least `bulk_tokens` prefill tokens has been measured (the fit's per-token cost is
its prior until then) such a step takes `bulk_tokens`. A long prompt alone on a quiet server
takes the whole budget: its steps' fixed cost is paid once per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kdaserve.engine.spec.step_cost import StepCostModel
from kdaserve.outputs import SchedulerOutput

_EWMA = 0.1


@dataclass
class DecodeGuard:
    max_slowdown: float = 2.0
    bulk_tokens: int = 256     # a prompt that brings more work than this is bulk
    min_chunk: int = 32        # a smaller bulk chunk is not worth its step's fixed cost
    window: int = 16           # the credit holds at most this many steps' earnings
    # the regressors, in StepCostModel's slots: (1, prefill tokens, decoding sequences,
    # [has prefill]); its prior (5 ms a step, 50 µs a token, 200 µs a sequence) holds until
    # the machine's own steps replace it
    cost: StepCostModel = field(default_factory=StepCostModel)
    credit: float = 0.0        # seconds
    # While latency-sensitive work ran within the last `recent_seconds` of steps, a step of
    # bulk alone aims to take at most `arrival_seconds` (by the fit), since a request that
    # arrives meanwhile waits for it (a decode burst's BURST_SECONDS, for prefill)
    arrival_seconds: float = 0.05
    # ... but its tokens cost at least this many times the step's fixed cost (a + d): on a
    # model whose weights are read from memory every step (a 32-token chunk already touches
    # every expert) the fixed cost is most of 50 ms, and 32-token chunks ran a 2,048-token
    # prompt after a batch at 0.47x its speed alone, without meeting the 50 ms either
    fixed_multiple: float = 2.0
    recent_seconds: float = 10.0
    quiet: float = math.inf    # step seconds since the last step with latency-sensitive work
    # the last budget's (b, extra, earned, cap); None: nothing sensitive waited on its step
    _last: tuple[float, float, float, float] | None = None
    _plain: tuple[float, float] | None = None   # decode-only steps: (seconds, rows), EWMA

    def observe(self, prefill_tokens: int, decoding: int, seconds: float) -> None:
        self.cost.observe(prefill_tokens, decoding, seconds, verifies=prefill_tokens > 0)
        self.quiet += seconds
        if not prefill_tokens and decoding and self.cost.seen > self.cost.warmup:
            # plain steps measured directly: the linear fit's intercept is pulled by the
            # long chunks' noise, and what a chunk adds is judged against the real thing
            self._plain = (seconds, decoding) if self._plain is None else (
                _EWMA * seconds + (1 - _EWMA) * self._plain[0],
                _EWMA * decoding + (1 - _EWMA) * self._plain[1])

    def _plain_seconds(self, rows: int) -> float:
        a, _, c, _ = self.cost.coefficients()
        if self._plain is None:
            return a + c * rows
        seconds, seen_rows = self._plain
        return max(1e-6, seconds + c * (rows - seen_rows))

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A finished step's cost, from what it carried."""
        if out.is_empty:
            return
        decoding = prefill = 0
        for seq in out.sequences:
            if seq.is_decode:
                decoding += 1
            else:
                prefill += len(seq.token_ids)
        self.observe(prefill, decoding, seconds)

    def is_bulk(self, tokens_left: int) -> bool:
        return tokens_left > self.bulk_tokens

    def bulk_budget(self, decoding: int, short_prompts: int) -> int | None:
        """Bulk prefill tokens this step may carry (0: none); None: no cap (nothing waits on
        the step, and nothing latency-sensitive ran in the last `recent_seconds` of steps;
        if something did, a step of bulk alone is cut to `arrival_seconds`).
        `short_prompts`: prompts of at most bulk_tokens that finish in the step (their first
        token waits on it too; each costs about as much as a decoding sequence here). Call
        charge() with what the step took."""
        sensitive = decoding + short_prompts
        a, b, c, d = self.cost.coefficients()
        if not sensitive:
            self.credit = 0.0
            self._last = None
            if self.quiet >= self.recent_seconds:
                return None
            if not any(row[1] >= self.bulk_tokens for row in self.cost.samples):
                return self.bulk_tokens       # the per-token cost is not measured yet
            per = max(b, 1e-12)
            tokens = max(self.arrival_seconds - a - d, self.fixed_multiple * (a + d)) / per
            return max(self.min_chunk, int(tokens))
        self.quiet = 0.0
        plain = self._plain_seconds(sensitive)
        earned = (self.max_slowdown - 1.0) * plain
        extra = a + c * sensitive + d - plain    # what any chunk adds, before its tokens
        # the cap always holds one smallest chunk: a long prompt is slowed, never stopped
        cap = max(self.window * earned, extra + b * self.min_chunk)
        self.credit = min(self.credit + earned, cap)
        tokens = int((self.credit - extra) / b)
        self._last = (b, extra, earned, cap)
        return tokens if tokens >= self.min_chunk else 0

    def step_budget(self, decoding: int, running: list[int], waiting: list[int],
                    free_slots: int) -> int | None:
        """bulk_budget() for a step being planned, from the work (tokens less prefix hits)
        that its running prefills and its waiting prompts brought: None when none of them is
        bulk (nothing to cut, no fit to solve: most steps). Short prompts count as waiting on
        the step if they run or a free slot admits them."""
        run = [self.is_bulk(w) for w in running]
        wait = [self.is_bulk(w) for w in waiting]
        if not any(run) and not any(wait):
            if decoding or running or waiting:
                self.saw_sensitive()
            return None
        short = run.count(False) + min(free_slots, wait.count(False))
        return self.bulk_budget(decoding, short)

    def saw_sensitive(self) -> None:
        """A step with latency-sensitive work and no bulk to cut."""
        self.quiet = 0.0

    def steps_to_chunk(self) -> int:
        """After a budget that held the bulk back: how many steps, this one included, run
        without bulk before the credit buys the smallest chunk (what a decode burst may
        replace; engine/decode_burst.py)."""
        if self._last is None or self._last[2] <= 0:
            return 1
        b, extra, earned, _ = self._last
        return max(1, math.ceil((extra + b * self.min_chunk - self.credit) / earned))

    def earn(self, steps: int) -> None:
        """A burst ran `steps` more forwards for the waiting rows, each earning what a
        plain step earns (its cost is their own measured one)."""
        if self._last is not None:
            _, _, earned, cap = self._last
            self.credit = min(self.credit + steps * earned, cap)

    def charge(self, tokens: int) -> None:
        """The bulk tokens this step took: what they cost comes off the credit."""
        if tokens > 0 and self._last is not None:
            b, extra, _, _ = self._last
            self.credit = max(0.0, self.credit - extra - b * tokens)


def take(req_work: int, n: int, guard: DecodeGuard | None, left: list[int] | None) -> int:
    """A chunk of n tokens, cut to the step's bulk room `left` ([tokens], consumed) when the
    request's prompt is bulk work (`req_work`: its tokens less its prefix hit); 0: it waits
    for the next step."""
    if guard is None or left is None or n <= 1 or not guard.is_bulk(req_work):
        return n
    n = min(n, left[0])
    left[0] -= n
    return n
