"""Owns the tensors: the model, the hybrid cache, per-request RNGs. One forward per step.

With speculative decoding a decode row carries the last token and its drafts; the forward keeps
the KDA state after each of its positions, verification decides how many drafts stand, and the
state after the last accepted one is committed to the slot (no second pass). MLA latents of
rejected positions stay in the pages, past the request's computed length, and are overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kdaserve.cache.ops import OpFailure
from kdaserve.cache.planner import CachePlan
from kdaserve.engine.cache_ops import CacheOpRunner, Store
from kdaserve.engine.encoder_cache import EncoderCache, embed_with_media
from kdaserve.engine.prompt_logprob_scoring import plan_rows, score
from kdaserve.engine.sampler import SamplingRow, sample
from kdaserve.engine.spec.proposer import Proposal, ProposalInput, Proposer
from kdaserve.engine.spec.rejection import VerifyRow, verify
from kdaserve.engine.step_message import RunnerRequest, RunnerRequests
from kdaserve.model import fused_decode
from kdaserve.model.base import HybridForCausalLM
from kdaserve.model.batch import ForwardBatch, HybridCache, build_forward_batch
from kdaserve.outputs import ModelRunnerOutput, SampledToken, ScheduledSequence, SchedulerOutput

if TYPE_CHECKING:
    from kdaserve.structured.manager import StructuredOutputs


@dataclass
class PreparedStep:
    """One forward's inputs, built from a step's sequences (each pipeline stage builds the
    same from the same message)."""

    seqs: list[ScheduledSequence]           # in forward order: decode rows first
    num_decode: int
    lens: list[int]
    starts: list[int]
    n_sample: int                           # logits rows that are sampled (the rest: prompt)
    prompt_rows: list
    snaps: list[tuple[int, int, int]]       # (row, position, snapshot id) taken in the forward
    spec_snaps: list[tuple[int, int, int]]  # the same on verify rows, taken once verified
    ids: torch.Tensor
    fb: ForwardBatch | None                 # None: the fused decode path
    fused: fused_decode.FusedDecoder | None
    wanted: list[int]                       # rows whose logits are wanted, sampled first
    kept: fused_decode.Kept | None = None   # a fused verify step's states after each token


class ModelRunner:
    def __init__(self, model: HybridForCausalLM, plan: CachePlan,
                 device: torch.device | str = "cpu", seed: int = 0,
                 proposer: Proposer | None = None,
                 stores: Mapping[str, Store] | None = None,
                 structured: StructuredOutputs | None = None) -> None:
        self.model = model
        self.structured = structured      # grammar masks (structured outputs)
        self.device = torch.device(device)
        self.cfg = model.config
        # a tensor-parallel rank holds its own heads' states (model.rank_config)
        self.cache = HybridCache.allocate(model.rank_config, plan.num_blocks, plan.block_size,
                                          plan.num_state_slots, model.dtype, self.device,
                                          num_snapshots=plan.num_snapshots)
        self.cache_ops = CacheOpRunner(self.cache, stores or {})   # offload tiers
        self.seed = seed
        self.proposer = proposer
        self._generators: dict[str, torch.Generator] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}
        self._unseeded = torch.Generator().manual_seed(seed)
        self.requests = RunnerRequests()     # what the step messages said of each request
        self.num_forward_tokens = 0
        self.encoder_cache = EncoderCache()     # image embeddings by content hash
        # compiled single-token decode for few rows (built on first use; False: not available)
        self._fused: fused_decode.FusedDecoder | None | bool = None
        self._threads = torch.get_num_threads()     # torch's, as the engine configured it

    def _generator(self, req: RunnerRequest) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self._unseeded
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = torch.Generator().manual_seed(seed)
        return gen

    @staticmethod
    def is_decode(s: ScheduledSequence) -> bool:
        return s.context_len > 0 and (len(s.token_ids) == 1 or s.num_draft_tokens > 0)

    @classmethod
    def order(cls, seqs: list[ScheduledSequence]) -> tuple[list[ScheduledSequence], int]:
        """Decode rows (one token with context, or a token and its drafts) first, as the
        model's batch layout requires; returns the ordered sequences and their number."""
        decode = [s for s in seqs if cls.is_decode(s)]
        rest = [s for s in seqs if not cls.is_decode(s)]
        return decode + rest, len(decode)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step from its self-contained message (see kdaserve/engine/step_message.py)."""
        failures, lost = self.begin(out)
        lost_snaps = [sid for rid, _, sid in out.snapshot_requests if rid in lost]
        step = self.prepare(out.sequences, out.snapshot_requests, lost)
        if step is None:
            return ModelRunnerOutput(sampled={}, dropped_snapshots=lost_snaps,
                                     cache_op_failures=failures)
        masks = self.start_masks(step)
        logits, captured, positions, cache_slots = self.forward(step, out.drafting)
        result = self.finish(step, logits, captured, positions, cache_slots, masks,
                             out.draft_limits, out.drafting)
        result.dropped_snapshots.extend(lost_snaps)
        result.cache_op_failures = failures
        return result

    # The phases of a step, apart so that a pipeline stage (kdaserve/distributed/pipeline.py)
    # can run its share: every stage begins and prepares, the last one finishes, the others
    # settle speculation once the last one has verified.
    def begin(self, out: SchedulerOutput) -> tuple[list[OpFailure], set[str]]:
        """Take in the message's request data, forget finished requests, run the cache ops.
        Returns the failures and the requests that lost their cache entry."""
        self.requests.apply(out)
        for rid in out.finished:
            self._generators.pop(rid, None)
            self._draft_probs.pop(rid, None)
            if self.structured is not None:
                self.structured.forget(rid)
        failures = self.cache_ops.run(out.cache_ops) if out.cache_ops else []
        # a request whose tier entry failed verification sits this step out (recomputed later)
        return failures, {f.request_id for f in failures if f.request_id is not None}

    def prepare(self, sequences: list[ScheduledSequence],
                snapshot_requests: list[tuple[str, int, int]], lost: set[str] = frozenset()
                ) -> PreparedStep | None:
        """The forward's layout for these sequences (None: nothing to run); restores the
        prefix-hit snapshots into their slots."""
        snap_reqs = [r for r in snapshot_requests if r[0] not in lost]
        keep = [s for s in sequences if s.request_id not in lost]
        if not keep:
            return None
        seqs, num_decode = self.order(keep)
        restores = [(s.state_slot, s.restore_snapshot) for s in seqs
                    if s.restore_snapshot is not None]
        if restores:
            self.cache.restore(torch.tensor([r[0] for r in restores], device=self.device),
                               torch.tensor([r[1] for r in restores], device=self.device))
        row = {s.request_id: i for i, s in enumerate(seqs)}
        speculating = {s.request_id for s in seqs if s.num_draft_tokens}
        snaps = [(row[rid], pos, sid) for rid, pos, sid in snap_reqs if rid not in speculating]
        spec_snaps = [(row[rid], pos, sid) for rid, pos, sid in snap_reqs if rid in speculating]
        lens = [len(s.token_ids) for s in seqs]
        wanted, starts, pos = [], [], 0
        for s, n in zip(seqs, lens):
            starts.append(pos)
            if s.num_draft_tokens:
                wanted.extend(range(pos, pos + n))
            elif s.sample:
                wanted.append(pos + n - 1)
            pos += n
        prompt_rows = plan_rows(seqs, starts, self.requests)       # only requests that ask
        n_sample = len(wanted)
        for r in prompt_rows:
            wanted.extend(r.at)
        fused = self._fused_decoder(seqs, num_decode) if not prompt_rows else None
        fb = None if fused is not None else build_forward_batch(
            lens, [s.context_len for s in seqs], num_decode=num_decode,
            conv_kernel=self.cfg.conv_kernel_size, chunk_size=self.model.chunk_size,
            cache=self.cache, block_tables=[s.block_ids for s in seqs],
            state_slots=[s.state_slot for s in seqs], logits_indices=wanted,
            snapshots=snaps or None, device=self.device,
        )
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long,
                           device=self.device)
        self.num_forward_tokens += len(ids)
        return PreparedStep(seqs, num_decode, lens, starts, n_sample, prompt_rows, snaps,
                            spec_snaps, ids, fb, fused, wanted)

    def start_masks(self, step: PreparedStep):
        """Grammar masks, computed on a worker thread while the model runs (None: none)."""
        if self.structured is None:
            return None
        return self.structured.prepare(step.seqs, self.requests)

    def forward(self, step: PreparedStep, drafting: bool = True):
        """The whole model over the step: (logits of the wanted rows, captured hidden
        states, positions [T], MLA cache slots [T] or None)."""
        capture = (self.proposer.capture_layers if self.proposer is not None and drafting
                   else ())
        seqs, fused, fb = step.seqs, step.fused, step.fb
        verifying = fused is not None and any(s.num_draft_tokens for s in seqs)
        parts = (fused_decode.split_parts(self._threads, len(seqs), capture, fused)
                 if fused is not None and not verifying else 1)
        # one torch thread while the rows run on `parts` threads (split_parts says why); the
        # configured count comes back with the next step that is not split
        threads = 1 if parts > 1 else self._threads
        if torch.get_num_threads() != threads:      # most steps: already so
            torch.set_num_threads(threads)
        if fused is not None:      # decode rows, maybe with drafts: no media or prompt logprobs
            captured = []
            positions, state_slots, table = fused_decode.step_inputs(seqs)
            # a token and its drafts are rows of their own; rejected drafts roll back to `kept`
            step.kept = (fused_decode.Kept.allocate(self.cache, len(step.ids)) if verifying
                         else None)
            last = [step.starts[b] + step.lens[b] - 1 for b in range(len(seqs))]
            logits = fused(step.ids, positions, state_slots, table, self.cache,
                           [(last[b], sid) for b, _, sid in step.snaps], capture, captured,
                           parts, step.kept)
            if verifying:
                logits = logits[step.wanted]
            cache_slots = None
            if capture:                         # where the draft's context pages go
                bs = self.cache.block_size
                cache_slots = (table.gather(1, (positions // bs)[:, None])[:, 0] * bs
                               + positions % bs)
            return logits, captured, positions, cache_slots
        embeds = (embed_with_media(self.model, step.ids, seqs, step.starts, self.encoder_cache)
                  if any(s.media for s in seqs) else None)
        logits, captured = self.model(step.ids, fb, capture_layers=capture,
                                      inputs_embeds=embeds)
        return logits, captured, fb.positions, fb.mla.slot_mapping

    def finish(self, step: PreparedStep, logits: torch.Tensor, captured: list[torch.Tensor],
               positions: torch.Tensor, cache_slots: torch.Tensor | None, masks,
               draft_limits: dict[str, int] | None, drafting: bool = True
               ) -> ModelRunnerOutput:
        """Sample (verify drafts), settle speculation in the cache, propose the next drafts."""
        requests, seqs = self.requests, step.seqs
        prompt_lps = (score(logits[step.n_sample:], step.prompt_rows) if step.prompt_rows
                      else {})
        logits = logits[:step.n_sample]
        sampled = self._sample(seqs, logits.cpu(), requests,
                               masks.result() if masks is not None else None)
        if masks is not None and self.proposer is not None:   # drafts are checked at once
            self.structured.advance(sampled)
        valid, dropped = self.settle(step, sampled)
        drafts: dict[str, list[int]] = {}
        if self.proposer is not None and not drafting:     # the drafter sleeps
            self.proposer.missed(step.seqs)
        elif self.proposer is not None and sampled:
            hidden = torch.cat(captured, -1) if captured else None
            rows = {rid: self._sampling_row(requests[rid]) for rid in sampled}
            props = self.proposer.propose(ProposalInput(
                seqs, valid, {rid: [t.token_id for t in ts] for rid, ts in sampled.items()},
                requests, positions, cache_slots, hidden, rows, draft_limits))
            drafts = self._keep_proposals(props)
        return ModelRunnerOutput(sampled=sampled, drafts=drafts, dropped_snapshots=dropped,
                                 prompt_logprobs=prompt_lps)

    def settle(self, step: PreparedStep, sampled: Mapping[str, list[SampledToken]]
               ) -> tuple[list[int], list[int]]:
        """How many tokens of each row stand (a verify row: those sampled), with the KDA
        state committed accordingly; returns them and the snapshot ids dropped."""
        valid = [len(sampled[s.request_id]) if s.num_draft_tokens else n
                 for s, n in zip(step.seqs, step.lens)]
        return valid, self._settle_speculation(step.fb, step.seqs, valid, step.spec_snaps,
                                               step.kept, step.starts)

    def _fused_decoder(self, seqs: list[ScheduledSequence], num_decode: int
                       ) -> fused_decode.FusedDecoder | None:
        if self._fused is False or not fused_decode.applies(seqs, num_decode):
            return None
        if self._fused is None or not self._fused.still_valid():
            self._fused = fused_decode.fused_decoder(self.model, self.cache) or False
        return self._fused or None

    def _sampling_row(self, req: RunnerRequest) -> SamplingRow:
        return SamplingRow(req.request_id, req.sampling_params, req.prompt_token_ids,
                           req.output_token_ids, self._generator(req))

    def _sample(self, seqs: list[ScheduledSequence], logits: torch.Tensor,
                requests: Mapping[str, RunnerRequest],
                masks: Mapping[str, torch.Tensor] | None = None,
                ) -> dict[str, list[SampledToken]]:
        """logits: the wanted rows in forward order (all positions of verify rows).
        masks: grammar bitmasks [positions, W] of the constrained requests."""
        masks = masks or {}
        plain_idx, plain_rows, ver_idx, ver_rows = [], [], [], []
        at = 0
        for s in seqs:
            if s.num_draft_tokens:
                n = s.num_draft_tokens + 1
                ver_idx.extend(range(at, at + n))
                probs = self._draft_probs.pop(s.request_id, None)
                if probs is not None:
                    probs = probs[: s.num_draft_tokens]
                ver_rows.append(VerifyRow(self._sampling_row(requests[s.request_id]),
                                          list(s.token_ids[1:]), probs,
                                          masks.get(s.request_id)))
                at += n
            elif s.sample:
                plain_idx.append(at)
                plain_rows.append(self._sampling_row(requests[s.request_id]))
                if s.request_id in masks:
                    plain_rows[-1].bitmask = masks[s.request_id][0]
                at += 1
        out: dict[str, list[SampledToken]] = {}
        if plain_rows:
            tokens = sample(logits[plain_idx], plain_rows)
            out.update({r.request_id: [t] for r, t in zip(plain_rows, tokens)})
        if ver_rows:
            tokens = verify(logits[ver_idx], ver_rows)
            out.update({v.row.request_id: t for v, t in zip(ver_rows, tokens)})
        return out

    def _settle_speculation(self, fb, seqs: list[ScheduledSequence], valid: list[int],
                            spec_snaps: list[tuple[int, int, int]],
                            kept: fused_decode.Kept | None = None,
                            starts: list[int] | None = None) -> list[int]:
        """Commit the KDA state after each verify row's last accepted token, take the
        snapshots that fall on accepted positions; returns the snapshot ids dropped. The
        states after each position come from the torch forward (`fb`) or, for a fused step,
        from `kept` (one row per token: token j of sequence b is row starts[b] + j)."""
        rolled = [(b, valid[b] - 1, s.state_slot) for b, s in enumerate(seqs)
                  if s.num_draft_tokens and valid[b] < len(s.token_ids)]
        taken, dropped = [], []
        for b, p, sid in spec_snaps:
            upto = p - seqs[b].context_len
            (taken if upto <= valid[b] else dropped).append((b, upto - 1, sid))
        c = self.cache
        for todo, states, convs in ((rolled, c.kda_states, c.kda_conv),
                                    (taken, c.snap_states, c.snap_conv)):
            if not todo or not self.cfg.kda_layers:
                continue
            b, upto, dest = (torch.tensor(x, device=self.device) for x in zip(*todo))
            if kept is not None:
                rows = torch.tensor(starts, device=self.device)[b] + upto
                kept.copy_to(rows, states, convs, dest)
            elif states is c.kda_states:
                c.commit_decode(fb, b, upto, dest)
            else:
                c.snapshot_decode(fb, b, upto, dest)
        return [sid for _, _, sid in dropped]

    def _keep_proposals(self, props: dict[str, Proposal]) -> dict[str, list[int]]:
        drafts = {}
        for rid, p in props.items():
            drafts[rid] = p.tokens
            if self.structured is not None:   # drafts the grammar refuses cannot be accepted
                drafts[rid] = self.structured.trim_drafts(rid, p.tokens)
            if p.probs is not None:
                self._draft_probs[rid] = p.probs
            else:
                self._draft_probs.pop(rid, None)
        return drafts
