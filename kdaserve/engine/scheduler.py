"""Decides how many tokens each request computes in a step. No tensors here.

Running requests go first (decodes, then partial prefills, each in admission order), then waiting
requests are admitted in FCFS (or priority) order while the token budget, `max_num_seqs` and the
cache allow. A prompt that does not fit the remaining budget is chunked. A partial prefill leaves
part of the budget (what waiting prompts need, at most half) for admissions, so a long prompt
neither delays its neighbours' decode steps nor holds new requests back until it is done.
When the cache cannot hold a running request's next tokens, the most recently admitted request
is preempted (and leaves this step if already scheduled): its cache is freed and it is
recomputed later from its prompt and the tokens it already produced.

Fairness between request groups: kdaserve/engine/fairness.py.

Failure isolation: requests reset after a failed step are "suspects"; while any is left, a step
runs one suspect alone, so the next failure names its request (see EngineCore.step).
"""

from __future__ import annotations

from collections import Counter, deque

from kdaserve.cache.manager import CacheManager
from kdaserve.cache.ops import (
    CacheOp,
    FreeRequest,
    RestoreSnapshot,
    SendRequest,
    SettleDrafts,
    TakeSnapshot,
)
from kdaserve.config import SchedulerConfig
from kdaserve.disagg import handoff
from kdaserve.engine import decode_burst, decode_guard, prompt_logprobs, step_results
from kdaserve.engine.fairness import fair_share_victim, next_waiting
from kdaserve.engine.lookahead import may_look_ahead
from kdaserve.engine.prompt_logprobs import wants_prompt_logprobs
from kdaserve.engine.spec.adaptive import AdaptiveSpeculation
from kdaserve.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
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
            alone = self._schedule_suspect()
            if alone is not None:
                return alone
        budget = self.config.max_num_batched_tokens
        chunk_cap = self.config.long_prefill_token_threshold or budget
        scheduled: list[tuple[Request, int]] = []
        self._scoring_left = [prompt_logprobs.TOKENS_PER_STEP]
        preempted: list[str] = self._fair_share()
        self._plan_drafts()
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
                n = min(n, budget - self._reserve_for_waiting(budget))
            n = prompt_logprobs.chunk(req, n, self._scoring_left)
            n = decode_guard.take(req.num_tokens - req.num_cached_tokens, n, self.guard,
                                  self._bulk_left)
            if n == 0:
                continue
            if n == 1 and req.spec_token_ids:
                d = self._num_drafts(req, budget)
                if d:
                    drafts[req.request_id] = d
                    n += d
            ok, refund = self._allocate_or_preempt(req, n, scheduled, preempted, drafts)
            budget += refund
            if ok:
                scheduled.append((req, n))
                budget -= n
        if len(preempted) == self._fair_preempted:
            self._admit(scheduled, budget, chunk_cap, drafts)
        if self._bulk_left is not None:
            self.guard.charge(self._bulk_granted - self._bulk_left[0])
        steps = (decode_burst.burst_steps(self, scheduled, preempted, drafts)
                 if self.max_burst > 1 else 1)
        seq_ops: list[CacheOp] = []
        seqs = [self._to_sequence(req, n, seq_ops, drafts.get(req.request_id, 0))
                for req, n in scheduled]
        self._restore.clear()
        limits = None
        # prefilling requests: what acceptance earns (a sleeping drafter proposes nothing)
        if self.spec_policy is not None and not self.spec_policy.dormant:
            limits = {req.request_id: self._draft_plan.get(req.request_id)
                      for req, _ in scheduled}
            first: dict[bool, int] = {}       # by kind (sampled or greedy), asked once a step
            for req, _ in scheduled:
                if limits[req.request_id] is None:
                    kind = not req.sampling_params.greedy
                    if kind not in first:
                        first[kind] = self.spec_policy.initial_drafts(
                            max(1, len(self.running)), kind)
                    limits[req.request_id] = first[kind]
        return SchedulerOutput(sequences=seqs, preempted=preempted,
                               ops=self._step_ops(seq_ops), draft_limits=limits,
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
        """This step's room for bulk prefill (engine/decode_guard.py), from what waits on
        the step: decoding requests, and short prompts (running, or waiting with a slot free
        to admit them) that end in it. A prompt is bulk by the work it brought (its tokens
        less its prefix hit), so a long prompt's last chunk stays bulk."""
        if self.guard is None:
            return None
        running = [self.guard.is_bulk(r.num_tokens - r.num_cached_tokens) for r in prefills]
        waiting = [self.guard.is_bulk(r.num_tokens - r.num_cached_tokens) for r in self.waiting]
        if not any(running) and not any(waiting):
            if decoding or prefills or self.waiting:
                self.guard.saw_sensitive()
            return None               # nothing to cut (and no fit to solve: most steps)
        free = self.config.max_num_seqs - len(self.running)
        short = running.count(False) + min(free, waiting.count(False))
        cap = self.guard.bulk_budget(decoding, short)
        self._bulk_granted = cap or 0
        return None if cap is None else [cap]

    def bulk_room(self) -> int | None:
        """The bulk prefill tokens the decode guard granted the step being planned; None:
        no cap."""
        return None if self._bulk_left is None else self._bulk_granted

    def _reserve_for_waiting(self, budget: int) -> int:
        """Budget a partial prefill leaves for admitting waiting requests (at most half the
        step), so a short request arriving during a long prefill starts at the next step
        instead of after the whole prompt. None when no slot is free to admit into."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return 0
        need = 0
        for req in self.waiting:
            need += req.num_tokens - req.num_computed_tokens
            if need >= budget // 2:
                return budget // 2
        return need

    def _fair_share(self) -> list[str]:
        """Preempt for a waiting group that has no running sequence (fairness.py)."""
        self._fair_preempted = 0
        victim = fair_share_victim(self.running, self.waiting, self.config.max_num_seqs)
        if victim is None:
            return []
        self.running.remove(victim)
        self._preempt(victim)
        self.num_fair_preemptions += 1
        self._fair_preempted = 1
        return [victim.request_id]

    def _admit(self, scheduled: list[tuple[Request, int]], budget: int, chunk_cap: int,
               drafts: dict[str, int]) -> None:
        counts = Counter(r.group for r in self.running)
        capped: set[str] = set()   # no room left this step for their kind of chunk
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            ready = [r for r in self.waiting if prompt_logprobs.leader_done(r, self.requests)
                     and r.request_id not in capped]
            if not ready:
                break
            req = next_waiting(ready, counts, self.config.policy)
            if req.num_pending:           # preempted with a token in flight: next step
                break
            hit = None
            imports = handoff.imports(req) and req.request_id not in self._imported
            if imports:
                # an import's hit: blocks this instance holds need not be written again; the
                # ones the hit query pinned for it first (the transfer leaves them out)
                hit = self.cache.held_hit(req.sampling_params.kv_transfer.transfer_id,
                                          req.prompt_token_ids, req.extra_keys, req.cache_salt)
                if hit is None:
                    hit = self.cache.find_hit(req.all_token_ids, req.extra_keys,
                                              req.cache_salt)
            elif req.num_computed_tokens == 0 and not wants_prompt_logprobs(req):
                hit = self.cache.find_hit(req.all_token_ids, req.extra_keys, req.cache_salt)
            if imports:               # the prompt's cache comes from a prefill instance
                computed = req.num_prompt_tokens
            else:
                computed = hit.num_tokens if hit is not None else req.num_computed_tokens
            n = prompt_logprobs.chunk(req, min(req.num_tokens - computed, budget, chunk_cap),
                                      self._scoring_left)
            n = decode_guard.take(req.num_tokens - computed, n, self.guard, self._bulk_left)
            if n == 0:
                # a scoring or bulk chunk with no room left: requests behind it of another
                # kind (a short prompt) still start this step
                capped.add(req.request_id)
                continue
            # an import's first step verifies the drafts its prefill instance proposed after
            # the first token (they came with its cache), as a colocated second step would
            d = self._num_drafts(req, budget) if imports and req.spec_token_ids else 0
            n += d
            if not self.cache.allocate(req.request_id, computed + n, hit):
                if not self.running and not scheduled:
                    # Alone and still too big: it can never fit; end it instead of spinning.
                    self.finish(req.request_id, RequestStatus.FINISHED_LENGTH)
                    self._ended.append(req.request_id)
                    continue
                break
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if imports:
                held = hit.num_tokens if hit is not None else 0
                req.num_computed_tokens, req.num_cached_tokens = computed, held
                self._imported.add(req.request_id)
                # the request shares the held blocks now: the hold's references can go
                self.cache.release_hold(req.sampling_params.kv_transfer.transfer_id)
                self._receives[req.request_id] = handoff.receive_op(
                    req, self.cache.block_ids(req.request_id), self.cache.slot(req.request_id),
                    held)
                hit = None            # the transfer's state replaces the hit's snapshot
                if d:
                    drafts[req.request_id] = d
            if hit is not None:
                req.num_computed_tokens = req.num_cached_tokens = hit.num_tokens
                if hit.snapshot is not None:
                    self._restore[req.request_id] = hit.snapshot.snapshot_id
            self.running.append(req)
            counts[req.group] += 1
            scheduled.append((req, n))
            budget -= n
            if self.spec_policy is not None:
                self.spec_policy.admitted(len(self.running), req.request_id,
                                          not req.sampling_params.greedy)

    def _num_drafts(self, req: Request, budget: int) -> int:
        """How many of the request's drafts to verify: never past max_tokens or max_model_len
        (the step yields drafts + 1 tokens), nor the step's token budget."""
        room = min(req.max_tokens - len(req.output_token_ids),
                   self.config.max_model_len - req.num_tokens) - 1
        planned = self._draft_plan.get(req.request_id, len(req.spec_token_ids))
        return max(0, min(len(req.spec_token_ids), planned, room, budget - 1))

    def _plan_drafts(self) -> None:
        """Adaptive speculation: drafts per decoding request for this step (see
        engine/spec/adaptive.py); the same numbers bound what is proposed for the next."""
        if self.spec_policy is None:
            self._draft_plan = {}
            return
        if self.spec_policy.dormant:          # the plan is all zeros: no drafts exist
            self._draft_plan = self.spec_policy.plan({}, max(1, len(self.running)))
            return
        candidates = {r.request_id: self.spec_policy.max_drafts for r in self.running
                      if r.num_computed_tokens == r.num_tokens - 1 or r.spec_token_ids}
        self._draft_plan = self.spec_policy.plan(candidates, max(1, len(self.running)))

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

    def _schedule_suspect(self) -> SchedulerOutput | None:
        self._suspects &= set(self.requests)
        req = next((r for r in self.waiting if r.request_id in self._suspects), None)
        if req is None:
            req = next((r for r in self.running if r.request_id in self._suspects), None)
        if req is None:
            return None
        budget = self.config.max_num_batched_tokens
        n = min(req.num_tokens - req.num_computed_tokens, budget,
                self.config.long_prefill_token_threshold or budget)
        if n <= 0 or not self.cache.allocate(req.request_id, req.num_computed_tokens + n):
            self._suspects.discard(req.request_id)   # cannot run alone: back to normal order
            return None
        if req in self.waiting:
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        seq_ops: list[CacheOp] = []
        seq = self._to_sequence(req, n, seq_ops)
        return SchedulerOutput(sequences=[seq], preempted=[], ops=self._step_ops(seq_ops),
                               drafting=self._drafting())

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

    def _to_sequence(self, req: Request, n: int, ops: list[CacheOp],
                     num_drafts: int = 0) -> ScheduledSequence:
        """The request's share of the step; its cache operations go to `ops`."""
        rid, start = req.request_id, req.num_computed_tokens
        slot = self.cache.slot(rid)
        tokens = req.token_ids_between(start, start + n - num_drafts)
        if num_drafts:
            tokens += req.spec_token_ids[:num_drafts]
        if rid in self._receives:
            ops.append(self._receives.pop(rid))
        block_ids = self.cache.block_ids(rid)
        push = (handoff.push_op(req, block_ids, self.cache.block_size, self._pushed.get(rid))
                if req.sampling_params.kv_transfer is not None else None)
        if push is not None:
            ops.append(push)
            self._pushed[rid] = (push.token_end, push.part + 1)
        if rid in self._restore:
            ops.append(RestoreSnapshot(rid, self._restore[rid], slot))
        if self.cache.prefix_caching:
            # Snapshots past a draft's position are taken only if that draft is accepted; the
            # runner reports the others as dropped (hashing drafts here is what they would be).
            all_ids = req.all_token_ids
            for pos, sid in self.cache.plan_snapshots(
                    rid, all_ids + tokens[1:] if num_drafts else all_ids,
                    req.num_prompt_tokens, start, start + n, req.extra_keys, req.cache_salt,
                    certain=start + n - num_drafts):
                ops.append(TakeSnapshot(rid, pos, sid))
        if num_drafts:
            ops.append(SettleDrafts(rid, slot))
        return ScheduledSequence(
            request_id=rid, token_ids=tokens, context_len=start,
            block_ids=block_ids, state_slot=slot,
            sample=start + n - num_drafts == req.num_tokens,
            num_draft_tokens=num_drafts,
            media=tuple(m for m in req.media if m.overlaps(start, start + n)) if req.media
            else (),
        )

    # ---- after the model ran ----------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what hit a stop
        (engine/step_results.py). Returns the requests that got a new token (finished ones
        included)."""
        return step_results.apply(self, out, result)
