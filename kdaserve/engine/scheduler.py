"""Decides how many tokens each request computes in a step. No tensors here.

Running requests go first (decodes, then partial prefills, each in admission order), then waiting
requests are admitted in FCFS (or priority) order while the token budget, `max_num_seqs` and the
cache allow. A prompt that does not fit the remaining budget is chunked. A partial prefill leaves
part of the budget (what waiting prompts need, at most half) for admissions, so a long prompt
neither delays its neighbours' decode steps nor holds new requests back until it is done.
When the cache cannot hold a running request's next tokens, the most recently admitted request
is preempted (and leaves this step if already scheduled): its cache is freed and it is
recomputed later from its prompt and the tokens it already produced.

Admission of waiting requests: engine/admission.py; fairness between request groups:
engine/fairness.py; drafts per request: engine/spec/draft_plan.py; failure isolation (one
suspect a step after a failed step): engine/suspects.py.
"""

from __future__ import annotations

from collections import Counter, deque

from kdaserve.cache.manager import CacheManager
from kdaserve.cache.ops import CacheOp, FreeRequest, SendRequest
from kdaserve.config import SchedulerConfig
from kdaserve.disagg import handoff
from kdaserve.engine import (
    admission,
    decode_burst,
    decode_guard,
    prompt_logprobs,
    step_results,
    suspects,
)
from kdaserve.engine.fairness import fair_share
from kdaserve.engine.lookahead import may_look_ahead
from kdaserve.engine.scheduled_sequence import sequence_for
from kdaserve.engine.spec import draft_plan
from kdaserve.engine.spec.adaptive import AdaptiveSpeculation
from kdaserve.outputs import ModelRunnerOutput, SchedulerOutput
from kdaserve.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager) -> None:
        self._scoring_left = [prompt_logprobs.TOKENS_PER_STEP]   # this step's (schedule())
        self.config = config
        self.guard = (decode_guard.DecodeGuard(config.max_decode_slowdown)
                      if config.max_decode_slowdown else None)
        self._bulk_left: list[int] | None = None        # this step's (decode_guard.take)
        self._bulk_granted = 0
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self._restore: dict[str, int] = {}
        self._ended: list[str] = []     # ended by the scheduler itself, not by a stop
        self.num_preemptions = 0
        self.num_verify_rows = 0        # speculative verifications (one request, one step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # verified blocks by acceptance length (accepted drafts + 1), and how often the draft at
        # each position of a block was accepted: /metrics' histogram and per-position counts
        self.acceptance_lengths: Counter[int] = Counter()
        self.accepted_by_position: Counter[int] = Counter()
        self.num_fair_preemptions = 0
        self.spec_policy: AdaptiveSpeculation | None = None   # set by the engine
        self._draft_plan: dict[str, int] = {}
        self._fair_preempted = 0
        self._suspects: set[str] = set()
        # multi-step decoding (engine/decode_burst.py): the most forwards a step may run (set
        # by the engine), and a plain decode step's measured time
        self.max_burst = 1
        self.decode_seconds = 0.0
        # disaggregation (kdaserve/disagg/handoff.py): caches to push once their request ended,
        # caches to take in when their request is admitted, requests whose transfer failed
        self._sends: list[SendRequest] = []
        self._receives: dict[str, CacheOp] = {}
        self._imported: set[str] = set()
        self._failed: dict[str, str] = {}
        self._pushed: dict[str, tuple[int, int]] = {}    # export: (tokens, parts) pushed

    # ---- intake ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                f"{self.config.max_model_len}"
            )
        capacity = self.cache.block_pool.num_blocks * self.cache.block_size
        if request.num_prompt_tokens > capacity:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the MLA cache holds {capacity}"
            )
        if request.max_model_len is None:
            request.max_model_len = self.config.max_model_len
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        pushed = self._pushed.pop(request_id, None)
        kt = req.sampling_params.kv_transfer
        if kt is not None and kt.is_import and request_id not in self._imported:
            self.cache.release_hold(kt.transfer_id)    # never admitted: its hold goes too
        send = (handoff.send_op(req, self.cache, pushed) if self.cache.holds(request_id)
                else None)
        if send is not None:
            self._sends.append(send)   # reads the blocks and slot freed below, before reuse
        self._imported.discard(request_id)
        self._receives.pop(request_id, None)
        self.cache.free(request_id)
        self._finished_since_step.append(request_id)
        if self.spec_policy is not None:
            self.spec_policy.forget(request_id)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.cache.begin_step()
        if self._suspects:
            alone = suspects.schedule_alone(self)
            if alone is not None:
                return alone
        budget = self.config.max_num_batched_tokens
        chunk_cap = self.config.long_prefill_token_threshold or budget
        scheduled: list[tuple[Request, int]] = []
        self._scoring_left = [prompt_logprobs.TOKENS_PER_STEP]
        preempted: list[str] = fair_share(self)
        draft_plan.plan(self)
        drafts: dict[str, int] = {}
        # Decodes first, then partial prefills: a long prompt's chunks never take the budget
        # its neighbours' next tokens need.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        self._bulk_left = self._bulk_budget(len(decodes), prefills)
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status == RequestStatus.PREEMPTED:     # earlier in this step
                continue
            if req.num_pending and not may_look_ahead(
                    req, self.cache.block_size, self.cache.prefix_caching,
                    self.config.max_model_len):
                continue                  # tokens in flight: it runs once they are known
            n = min(req.num_tokens - req.num_computed_tokens, budget, chunk_cap)
            if n > 1:
                n = min(n, budget - admission.reserve_for_waiting(self, budget))
            n = prompt_logprobs.chunk(req, n, self._scoring_left)
            n = decode_guard.take(req.num_tokens - req.num_cached_tokens, n, self.guard,
                                  self._bulk_left)
            if n == 0:
                continue
            if n == 1 and req.spec_token_ids:
                d = draft_plan.num_drafts(self, req, budget)
                if d:
                    drafts[req.request_id] = d
                    n += d
            ok, refund = self._allocate_or_preempt(req, n, scheduled, preempted, drafts)
            budget += refund
            if ok:
                scheduled.append((req, n))
                budget -= n
        if len(preempted) == self._fair_preempted:
            admission.admit(self, scheduled, budget, chunk_cap, drafts)
        if self._bulk_left is not None:
            self.guard.charge(self._bulk_granted - self._bulk_left[0])
        steps = (decode_burst.burst_steps(self, scheduled, preempted, drafts)
                 if self.max_burst > 1 else 1)
        seq_ops: list[CacheOp] = []
        seqs = [sequence_for(self, req, n, seq_ops, drafts.get(req.request_id, 0))
                for req, n in scheduled]
        self._restore.clear()
        return SchedulerOutput(sequences=seqs, preempted=preempted,
                               ops=self._step_ops(seq_ops),
                               draft_limits=draft_plan.limits(self, scheduled),
                               drafting=self._drafting(), num_steps=steps)

    def _step_ops(self, seq_ops: list[CacheOp]) -> list[CacheOp]:
        """The step's cache operations in the order they run: frees, then the manager's
        (offload stores before the forward reuses an id, loads before it reads one; taken
        after every allocation and snapshot plan of the step, which may evict), then each
        sequence's restores, snapshots and settling of drafts."""
        finished, self._finished_since_step = self._finished_since_step, []
        return [*(FreeRequest(rid) for rid in finished), *self.cache.take_ops(), *seq_ops]

    def _allocate_or_preempt(self, req: Request, n: int, scheduled: list[tuple[Request, int]],
                             preempted: list[str], drafts: dict[str, int]) -> tuple[bool, int]:
        """Room for req's next n tokens, preempting the newest running requests until it fits.
        A victim already scheduled leaves this step; returns (req still runs, budget freed)."""
        refund = 0
        while not self.cache.allocate(req.request_id, req.num_computed_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            drafts.pop(victim.request_id, None)
            for j, (r, k) in enumerate(scheduled):
                if r is victim:
                    del scheduled[j]
                    refund += k
                    break
            if victim is req:
                return False, refund
        return True, refund

    def _bulk_budget(self, decoding: int, prefills: list[Request]) -> list[int] | None:
        """This step's room for bulk prefill (engine/decode_guard.py). A prompt is bulk by
        the work it brought (its tokens less its prefix hit), so a long prompt's last chunk
        stays bulk."""
        if self.guard is None:
            return None
        cap = self.guard.step_budget(
            decoding, [r.num_tokens - r.num_cached_tokens for r in prefills],
            [r.num_tokens - r.num_cached_tokens for r in self.waiting],
            self.config.max_num_seqs - len(self.running))
        self._bulk_granted = cap or 0
        return None if cap is None else [cap]

    def bulk_room(self) -> int | None:
        """The bulk prefill tokens the decode guard granted the step being planned; None:
        no cap."""
        return None if self._bulk_left is None else self._bulk_granted

    def take_sends(self) -> list[SendRequest]:
        """Caches to push now (their requests ended since the last call); the engine runs
        them before the next step can reuse their blocks and slots."""
        sends, self._sends = self._sends, []
        return sends

    def pop_failed(self) -> dict[str, str]:
        """Requests ended because their cache transfer failed, with the reason."""
        failed, self._failed = self._failed, {}
        return failed

    def pop_ended(self) -> list[str]:
        """Requests the scheduler ended on its own since the last call (too large to fit)."""
        ended, self._ended = self._ended, []
        return ended

    # ---- failure isolation ---------------------------------------------------------------------
    def reset_for_retry(self, request_id: str) -> None:
        """After a failed step: free the request's cache and requeue it as a suspect."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if req in self.running:
            self.running.remove(req)
            self._preempt(req)
        self._suspects.add(request_id)

    def cleared(self, request_id: str) -> None:
        """A step that ran this request alone succeeded."""
        self._suspects.discard(request_id)

    def _drafting(self) -> bool:
        return self.spec_policy is None or not self.spec_policy.dormant

    def _preempt(self, req: Request) -> None:
        self.cache.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the model ran ----------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what hit a stop
        (engine/step_results.py). Returns the requests that got a new token (finished ones
        included)."""
        return step_results.apply(self, out, result)
