"""Owns the tensors: the model, the hybrid cache, per-request RNGs. One forward per step.

A step is a short loop: run the cache operations that precede the forward, build the plan,
forward, sample (verify drafts), settle the speculative states, propose, report. The fused CPU
decoder and the torch forward sit behind one `forward(plan) -> ForwardResult`.

With speculative decoding a decode row carries the last token and its drafts; the forward keeps
the KDA state after each of its positions, verification decides how many drafts stand, and the
state after the last accepted one is committed to the slot (no second pass). MLA latents of
rejected positions stay in the pages, past the request's computed length, and are overwritten.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kdaserve.cache.planner import CachePlan
from kdaserve.engine.burst_forwards import run_burst
from kdaserve.engine.cache_ops import CacheOpExecutor, StepOps
from kdaserve.engine.decode_graphs import CaptureReport, DecodeGraphs, graph_sizes
from kdaserve.engine.decode_inputs import DecodeInputs
from kdaserve.engine.encoder_cache import EncoderCache, embed_with_media
from kdaserve.engine.prompt_logprob_scoring import score
from kdaserve.engine.row_sampling import RowSampler
from kdaserve.engine.spec.drafting import propose_drafts
from kdaserve.engine.spec.proposer import Proposer
from kdaserve.engine.step_message import RunnerRequests
from kdaserve.engine.step_plan import StepPlan, plan_step
from kdaserve.engine.tier_transfer import Store
from kdaserve.model import fused_decode
from kdaserve.model.base import HybridForCausalLM
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.kept_states import ForwardKept, FusedKept, KeptStates
from kdaserve.outputs import ModelRunnerOutput, SampledToken, ScheduledSequence, SchedulerOutput
from kdaserve.request import PENDING

if TYPE_CHECKING:
    from kdaserve.structured.manager import StructuredOutputs


@dataclass
class ForwardResult:
    """What a forward hands to sampling, whichever forward ran."""

    logits: torch.Tensor                 # [wanted rows, vocab]
    captured: list[torch.Tensor]         # the stream after the proposer's layers (its context)
    positions: torch.Tensor              # [T]
    cache_slots: torch.Tensor | None     # [T] MLA cache rows of the tokens (None: not needed)
    kept: KeptStates | None = None       # states after each position of the verify rows


class ModelRunner:
    def __init__(self, model: HybridForCausalLM, plan: CachePlan,
                 device: torch.device | str = "cpu", seed: int = 0,
                 proposer: Proposer | None = None,
                 stores: Mapping[str, Store] | None = None,
                 structured: StructuredOutputs | None = None,
                 device_resident: bool | None = None, graphs: str | None = None) -> None:
        """device_resident: decode steps that the torch forward runs read persistent input
        buffers and never wait on the device (engine/decode_inputs.py); by default on CUDA.
        KDASERVE_DEVICE_RESIDENT=1 turns it on anywhere (the CPU tests), =0 off.
        graphs: "cuda" or "replay" (CPU) to replay decode steps from captured graphs once
        `capture_graphs` has run (engine/decode_graphs.py); the cache then holds one more KDA
        slot and MLA block, for padding rows."""
        self.model = model
        self.structured = structured      # grammar masks (structured outputs)
        self.device = torch.device(device)
        self.cfg = model.config
        # a tensor-parallel rank holds its own heads' states (model.rank_config)
        pad = 1 if graphs else 0
        self.cache = HybridCache.allocate(model.rank_config, plan.num_blocks + pad,
                                          plan.block_size, plan.num_state_slots + pad,
                                          model.dtype, self.device,
                                          num_snapshots=plan.num_snapshots,
                                          kv_cache_dtype=plan.kv_cache_dtype)
        self._graph_backend, self._pad = graphs, (plan.num_state_slots, plan.num_blocks)
        self.graphs: DecodeGraphs | None = None
        self.cache_ops = CacheOpExecutor(self.cache, stores or {}, on_free=self._forget)
        self.proposer = proposer
        self.sampler = RowSampler(seed)
        self.requests = RunnerRequests()     # what the step messages said of each request
        self.num_forward_tokens = 0
        self.encoder_cache = EncoderCache()     # image embeddings by content hash
        # compiled single-token decode for few rows (built on first use; False: not available)
        self._fused: fused_decode.FusedDecoder | None | bool = None
        self._row_inputs = fused_decode.RowInputs()
        self._threads = torch.get_num_threads()     # torch's, as the engine configured it
        if device_resident is None:
            env = os.environ.get("KDASERVE_DEVICE_RESIDENT", "")
            device_resident = env == "1" or (self.device.type == "cuda" and env != "0")
        self.decode_inputs = DecodeInputs(self.device) if device_resident else None

    @property
    def threads(self) -> int:
        """The forward's thread count (the engine's configured one until set_threads)."""
        return self._threads

    def set_threads(self, threads: int) -> None:
        """The forward's thread count from the next step on (engine/cpu_share.py)."""
        self._threads = max(1, threads)

    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, max_len: int) -> CaptureReport:
        """Capture a decode graph for each padded batch size (startup)."""
        assert self._graph_backend is not None, "the runner was built without graphs"
        sizes = graph_sizes(max_num_seqs)
        width = -(-max_len // self.cache.block_size)
        self.decode_inputs = DecodeInputs(self.device, rows=sizes[-1], width=width, fixed=True)
        capture = self.proposer.capture_layers if self.proposer is not None else ()
        self.graphs = DecodeGraphs(self.model, self.cache, self.decode_inputs, *self._pad,
                                   capture_layers=capture, backend=self._graph_backend)
        return self.graphs.capture(sizes)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step from its self-contained message (see kdaserve/engine/step_message.py)."""
        ops = self.begin(out)
        plan = self.plan(out.sequences, ops)
        if plan is not None:
            masks = self.start_masks(plan)
            result = self.finish(plan, self.forward(plan, out.drafting), masks, ops,
                                 out.draft_limits, out.drafting)
            if out.num_steps > 1:
                run_burst(self, plan, result, out.num_steps)
        else:
            result = ModelRunnerOutput(sampled={})
        result.cache = ops.outcome
        return result

    # The phases of a step, apart so that a pipeline stage (kdaserve/distributed/pipeline.py)
    # can run its share: every stage begins and plans, the last one finishes, the others
    # settle speculation once the last one has verified.
    def begin(self, out: SchedulerOutput) -> StepOps:
        """Take in the message's request data; run the cache operations before the forward.
        A PENDING input token (async scheduling: sampled by the step before, whose result the
        scheduler had not seen) is the one this runner sampled (engine/lookahead.py)."""
        self.requests.apply(out)
        if any(t == PENDING for s in out.sequences for t in s.token_ids):
            out.sequences = [self._known(s) for s in out.sequences]
        return self.cache_ops.begin(out.ops)

    def _known(self, seq: ScheduledSequence) -> ScheduledSequence:
        if PENDING not in seq.token_ids:
            return seq
        mine = self.requests[seq.request_id].all_token_ids
        return replace(seq, token_ids=[mine[seq.context_len + i] if t == PENDING else t
                                       for i, t in enumerate(seq.token_ids)])

    def _forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        if self.structured is not None:
            self.structured.forget(request_id)

    def plan(self, sequences: list[ScheduledSequence], ops: StepOps,
             persistent: bool = True) -> StepPlan | None:
        """persistent=False: fresh input tensors even for a device-resident decode step (a
        pipeline stage plans all its micro-batches before running them: one set of buffers
        would hold only the last one's)."""
        plan = plan_step(sequences, ops, self.requests, self.cache, self.cfg.conv_kernel_size,
                         self.model.chunk_size, self.device, self._fused_decoder,
                         self.decode_inputs if persistent else None,
                         self.graphs if persistent else None)
        if plan is not None:
            self.num_forward_tokens += sum(plan.lens)
        return plan

    def start_masks(self, plan: StepPlan):
        """Grammar masks, computed on a worker thread while the model runs (None: none)."""
        if self.structured is None:
            return None
        return self.structured.prepare(plan.seqs, self.requests)

    def forward(self, plan: StepPlan, drafting: bool = True,
                advance: list[int] | None = None) -> ForwardResult:
        """The whole model over the step. `advance`: a fused plan that just ran, each row
        one position on with this token (a burst's next forward, engine/decode_burst.py)."""
        capture = (self.proposer.capture_layers if self.proposer is not None and drafting
                   else ())
        parts = (fused_decode.split_parts(self._threads, len(plan.seqs), capture, plan.fused)
                 if plan.fused is not None and not plan.verifying else 1)
        # one torch thread while the rows run on `parts` threads (split_parts says why); the
        # configured count comes back with the next step that is not split
        threads = 1 if parts > 1 else self._threads
        if torch.get_num_threads() != threads:      # most steps: already so
            torch.set_num_threads(threads)
        if plan.fused is not None:
            return self._forward_fused(plan, capture, parts, advance)
        if plan.graph is not None:
            return self._forward_graph(plan, capture)
        return self._forward_torch(plan, capture)

    def _forward_graph(self, plan: StepPlan, capture: tuple[int, ...]) -> ForwardResult:
        """A decode step replayed from its captured graph (the inputs are in the buffers)."""
        step = self.graphs.replay(plan.graph)
        n = len(plan.seqs)
        if plan.snapshots:          # decode rows snapshot their final state: the slot's now
            dev = self.device
            self.cache.save_slots(
                torch.tensor([plan.seqs[s.row].state_slot for s in plan.snapshots], device=dev),
                torch.tensor([s.snapshot_id for s in plan.snapshots], device=dev))
        if not capture:
            return ForwardResult(step.logits[:n], [], step.inputs.positions[:n], None)
        # the buffers and outputs are rewritten next step; a sleeping drafter keeps these
        return ForwardResult(step.logits[:n], [c[:n] for c in step.captured],
                             step.inputs.positions[:n].clone(),
                             step.fb.mla.slot_mapping[:n].clone())

    def _forward_fused(self, plan: StepPlan, capture: tuple[int, ...], parts: int,
                       advance: list[int] | None = None) -> ForwardResult:
        """Decode rows, maybe with drafts (no media or prompt logprobs): one row per token,
        a token and its drafts each a row of the request's slot."""
        captured: list[torch.Tensor] = []
        if advance is None:
            ids, positions, state_slots, table = self._row_inputs.fill(plan.seqs)
        else:
            ids, positions, state_slots, table = self._row_inputs.advance(advance)
            self.num_forward_tokens += len(advance)
        kept = fused_decode.Kept.allocate(self.cache, len(ids)) if plan.verifying else None
        last = [plan.starts[b] + plan.lens[b] - 1 for b in range(len(plan.seqs))]
        logits = plan.fused(ids, positions, state_slots, table, self.cache,
                            [(last[s.row], s.snapshot_id) for s in plan.snapshots], capture,
                            captured, parts, kept)
        if kept is not None:
            logits = logits[plan.wanted]
        cache_slots = None
        if capture:                         # where the draft's context pages go
            bs = self.cache.block_size
            cache_slots = (table.gather(1, (positions // bs)[:, None])[:, 0] * bs
                           + positions % bs)
            positions = positions.clone()   # the buffer is filled again next step
        return ForwardResult(logits, captured, positions, cache_slots,
                             FusedKept(kept, plan.starts) if kept is not None else None)

    def _forward_torch(self, plan: StepPlan, capture: tuple[int, ...]) -> ForwardResult:
        fb = plan.fb
        embeds = (embed_with_media(self.model, plan.ids, plan.seqs, plan.starts,
                                   self.encoder_cache)
                  if any(s.media for s in plan.seqs) else None)
        logits, captured = self.model(plan.ids, fb, capture_layers=capture,
                                      inputs_embeds=embeds)
        # persistent inputs are rewritten next step; a sleeping drafter keeps the positions
        positions = fb.positions.clone() if fb.sync_free and capture else fb.positions
        return ForwardResult(logits, captured, positions, fb.mla.slot_mapping,
                             ForwardKept(fb) if fb.decode is not None else None)

    def finish(self, plan: StepPlan, fwd: ForwardResult, masks, ops: StepOps,
               draft_limits: dict[str, int] | None, drafting: bool = True,
               propose: bool = True) -> ModelRunnerOutput:
        """Sample (verify drafts), settle speculation in the cache, propose the next drafts.
        The cache operations' outcome is the caller's to attach (once per step). propose
        False: the proposer hears nothing (a burst's later forwards tell it themselves)."""
        requests, seqs = self.requests, plan.seqs
        logits = fwd.logits
        prompt_lps = (score(logits[plan.n_sample:], plan.prompt_rows) if plan.prompt_rows
                      else {})
        sampled = self.sampler.sample(seqs, logits[:plan.n_sample], requests,
                                      masks.result() if masks is not None else None)
        if masks is not None and self.proposer is not None:   # drafts are checked at once
            self.structured.advance(sampled)
        valid = self.settle(plan, ops, fwd.kept, sampled)
        drafts: dict[str, list[int]] = {}
        draft_seconds = 0.0
        if self.proposer is not None and propose:
            drafts, draft_seconds = propose_drafts(self, seqs, valid, sampled, fwd.captured,
                                                   fwd.positions, fwd.cache_slots,
                                                   draft_limits, drafting)
        for rid, toks in sampled.items():    # the next step may name them PENDING
            requests[rid].output_token_ids.extend(t.token_id for t in toks)
        errors = self.structured.take_failures() if masks is not None else {}
        return ModelRunnerOutput(sampled=sampled, drafts=drafts, prompt_logprobs=prompt_lps,
                                 grammar_errors=errors, draft_seconds=draft_seconds)

    def settle(self, plan: StepPlan, ops: StepOps, kept: KeptStates | None,
               sampled: Mapping[str, list[SampledToken]]) -> list[int]:
        """How many tokens of each row stand (a verify row: those sampled), with the KDA
        states settled accordingly (kdaserve/engine/cache_ops.py)."""
        valid = [len(sampled[s.request_id]) if s.num_draft_tokens else n
                 for s, n in zip(plan.seqs, plan.lens)]
        self.cache_ops.settle(ops, plan.seqs, valid, kept)
        return valid

    def _fused_decoder(self, seqs: list[ScheduledSequence], num_decode: int
                       ) -> fused_decode.FusedDecoder | None:
        if self._fused is False or not fused_decode.applies(seqs, num_decode):
            return None
        if self._fused is None or not self._fused.still_valid():
            self._fused = fused_decode.fused_decoder(self.model, self.cache) or False
        return self._fused or None
