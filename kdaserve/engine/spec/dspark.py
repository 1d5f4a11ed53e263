"""The DSpark proposer: ingests the target's hidden states into the draft's MLA pages (same block
ids as the target's pages), then drafts a block of k tokens per request in one draft forward.

Legend: B requests drafting, L context positions, k drafts, V vocab.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kdaserve.config import EngineConfig, SpeculativeConfig
from kdaserve.engine.sampler import Penalties, SamplingRow
from kdaserve.engine.spec.proposer import Proposal, ProposalInput
from kdaserve.engine.spec.rejection import _draw, target_probs
from kdaserve.model.base import HybridForCausalLM
from kdaserve.model.registry import load_draft


class DSparkProposer:
    MAX_PENDING = 512        # context rows held before they are projected anyway
    MAX_MISSED = 1 << 16     # slots written asleep held before they are invalidated anyway
    greedy_drafts = False    # --speculative-config draft_sample_method "greedy"

    def __init__(self, draft: nn.Module, target: HybridForCausalLM, num_tokens: int,
                 num_blocks: int, block_size: int, device: torch.device) -> None:
        cfg = draft.config
        self.draft, self.target = draft, target
        self.num_tokens = min(num_tokens, cfg.block_size)
        self.block = cfg.block_size
        self.capture_layers = tuple(cfg.target_layer_ids)
        # the most context positions a block attends to, the newest (None: all): a draft
        # trained on short sequences never saw its queries that far from their keys
        self.window = cfg.context_window
        self.block_size = block_size
        self.device = device
        self.pages = [torch.zeros(num_blocks, block_size, cfg.mla_latent_dim,
                                  dtype=target.dtype, device=device) for _ in draft.layers]
        # context not yet projected into the pages: (hidden, positions, page slots) per step.
        # Projected when a draft is next needed, in one call, so that steps in which no
        # request drafts (adaptive speculation off) pay a copy instead of a draft projection.
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending_rows = 0
        # which page slots hold their owner's context latents. A slot is valid once its latents
        # are projected, invalid while its latents wait in _pending (never ingested yet) and once
        # a step that ran while the drafter slept (adaptive speculation) wrote it. The draft
        # attends only to valid slots: a request that was running while the drafter slept is
        # drafted from the context captured since it woke (see `missed`).
        self._valid = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
        self._missed: list[int] = []     # slots written asleep, not yet marked invalid
        # the work the drafter did, in rows (tests and bench compare it with plain decoding)
        self.rows_captured = 0       # target hidden-state rows handed to the drafter
        self.rows_projected = 0      # context rows projected into the draft's pages
        self.rows_drafted = 0        # draft forward rows (block positions per drafting request)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, config: EngineConfig,
                    target: HybridForCausalLM, device: torch.device,
                    num_blocks: int, block_size: int) -> DSparkProposer:
        path = Path(spec.draft_model) if spec.draft_model else Path(config.model) / "draft"
        draft = load_draft(path, dtype=target.dtype, device=device)
        draft.bind_target(target.model.embed_tokens)
        if draft.config.hidden_size != target.config.hidden_size or \
                draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"draft {path} does not fit the target (hidden/vocab size differ)")
        if max(draft.config.target_layer_ids) >= target.config.num_hidden_layers:
            raise ValueError(f"draft {path} reads target layers the target does not have")
        proposer = cls(draft, target, spec.num_speculative_tokens, num_blocks, block_size,
                       device)
        proposer.greedy_drafts = spec.draft_sample_method == "greedy"
        return proposer

    @torch.inference_mode()
    def propose(self, inp: ProposalInput) -> dict[str, Proposal]:
        seqs = inp.seqs
        self._forget_missed()            # before this step's writes: they came after
        starts, pos = [], 0
        for s in seqs:
            starts.append(pos)
            pos += len(s.token_ids)
        # 1. the target's hidden states of every position that stands become draft context
        valid = sum(inp.num_valid)
        if valid == len(inp.positions):                  # no draft rejected: all of them
            entry = (inp.hidden, inp.positions, inp.cache_slots)
        else:
            rows = torch.tensor([starts[b] + j for b, m in enumerate(inp.num_valid)
                                 for j in range(m)], dtype=torch.long, device=self.device)
            entry = (inp.hidden[rows], inp.positions[rows], inp.cache_slots[rows])
        self._pending.append(entry)
        self._valid.index_fill_(0, entry[2], False)      # not in the pages until ingested
        self._pending_rows += valid
        self.rows_captured += valid
        # 2. one block per request that sampled: its newest token, then mask positions
        drafting = [(b, s) for b, s in enumerate(seqs) if s.request_id in inp.new_tokens
                    and inp.limit(s.request_id, self.num_tokens) > 0]
        if not drafting:
            if self._pending_rows >= self.MAX_PENDING:
                self._ingest()
            return {}
        self._ingest()
        limits = [inp.limit(s.request_id, self.num_tokens) for _, s in drafting]
        k = max(limits)
        first_tok = torch.tensor([inp.new_tokens[s.request_id][-1] for _, s in drafting],
                                 device=self.device)
        ctx_len = torch.tensor([s.context_len + inp.num_valid[b] for b, s in drafting],
                               device=self.device)                                   # [B]
        B = len(drafting)
        width = max(len(s.block_ids) for _, s in drafting)
        bt = torch.zeros(B, width, dtype=torch.long)
        for i, (_, s) in enumerate(drafting):
            bt[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.long)
        bt = bt.to(self.device)
        # each row's newest `window` positions (all of them without a window)
        first_pos = (ctx_len - self.window).clamp(min=0) if self.window else ctx_len * 0
        L = int((ctx_len - first_pos).max())
        j = first_pos[:, None] + torch.arange(L, device=self.device)[None]          # [B,L]
        blk = (j // self.block_size).clamp(max=width - 1)
        ctx_rows = bt.gather(1, blk) * self.block_size + j % self.block_size        # [B,L]
        # context the drafter missed while it slept is left out (`missed`)
        ctx_mask = (j < ctx_len[:, None]) & self._valid[ctx_rows]
        ctx = [page.view(-1, page.shape[-1])[ctx_rows] for page in self.pages]
        mask = torch.cat([ctx_mask[:, None].expand(B, self.block, L),
                          torch.ones(B, self.block, self.block, dtype=torch.bool,
                                     device=self.device)], -1)
        positions = ctx_len[:, None] + torch.arange(self.block, device=self.device)[None]
        first = self.target.model.embed_tokens(first_tok)[:, None]
        rows = [inp.sampling[s.request_id] for _, s in drafting]
        temps = (torch.tensor([r.params.temperature for r in rows], device=self.device)
                 if self.draft.config.temperature_conditioning else None)
        h = self.draft.block_hidden(first, positions, ctx, mask, self.block, temps)[:, :k]
        self.rows_drafted += B * self.block
        logits = self.target.lm_head(h).float()                                      # [B,k,V]
        # the history the verifier will penalise with: outputs, this step's tokens, drafts
        hist = [SamplingRow(r.request_id, r.params, r.prompt_token_ids,
                            r.output_token_ids + inp.new_tokens[r.request_id], r.generator)
                for r in rows]
        props = self._pick(logits, first_tok, hist, [s.request_id for _, s in drafting])
        return {rid: Proposal(p.tokens[:n], None if p.probs is None else p.probs[:n])
                for (rid, p), n in zip(props.items(), limits)}

    def missed(self, seqs, offset: int = 0) -> None:
        """A step ran while the drafter slept: the slots it wrote hold no draft context now
        (each row's tokens from position context_len + offset on: Proposer.missed).

        The draft's context is the target's hidden states at its layers, and the target's
        cache cannot give them back (MLA latents are a rank-reducing projection of one layer's
        input, KDA states a running summary), so rebuilding them means a second target forward
        over the context: a prefill's cost, which is what the sleep saves. A woken drafter
        therefore drafts for such a request from the context captured since it woke (its
        slots written before the sleep stay valid). Rows captured before the sleep and not
        yet projected are dropped, not projected now: their slots stay invalid (a dormant
        drafter projects nothing) and they are at most `sleep_after` steps of a draft that
        earned nothing, plus prompts prefilled in that stretch.
        """
        if self._pending:
            self._pending, self._pending_rows = [], 0
        bs, slots = self.block_size, self._missed
        for s in seqs:
            ids, p0, n = s.block_ids, s.context_len + offset, len(s.token_ids)
            if n == 1:          # a decode row: most of a sleeping drafter's steps
                slots.append(ids[p0 // bs] * bs + p0 % bs)
            else:
                slots.extend(ids[p // bs] * bs + p % bs for p in range(p0, p0 + n))
        if len(slots) >= self.MAX_MISSED:
            self._forget_missed()

    def forget_context(self) -> None:
        """Steps ran without the drafter (`kdaserve bench spec`'s plain runs): they wrote
        slots it was never told of, so none holds context it can trust."""
        self._pending, self._pending_rows, self._missed = [], 0, []
        self._valid.fill_(False)

    def _forget_missed(self) -> None:
        """The slots written asleep leave the draft's context, in one call: kept as plain ints
        until a draft is next needed (a tensor and an index_fill per sleeping step cost ~1% of
        a fused CPU decode step at batch 32). Nothing reads `_valid` before that, and a slot is
        valid again only once projected after it."""
        if self._missed:
            self._valid.index_fill_(0, torch.tensor(self._missed, dtype=torch.long,
                                                    device=self.device), False)
            self._missed = []

    # ---- disaggregation: a request's draft context moves with its cache (kdaserve/disagg) ----
    def _rows(self, block_ids, start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(start, end)],
                            dtype=torch.long, device=self.device)

    def export_context(self, block_ids, num_tokens: int, start: int = 0
                       ) -> list[torch.Tensor]:
        """Host copies of the draft's context of a request's positions [start, num_tokens):
        each draft layer's latents [num_tokens - start, D], then which of them hold context
        ([num_tokens - start] uint8). Pending context is projected first, as the next draft
        would."""
        self._ingest()
        rows = self._rows(block_ids, start, num_tokens)
        out = [p.view(-1, p.shape[-1])[rows].cpu() for p in self.pages]
        return out + [self._valid[rows].to(torch.uint8).cpu()]

    def import_context(self, block_ids, start: int, num_tokens: int,
                       context: list[torch.Tensor], context_start: int = 0) -> None:
        """Positions [start, num_tokens) of a request's draft context, as `export_context`
        gave them on another instance (from position `context_start` <= start on). Context
        still pending here is projected first: its slots may be this request's now (a reused
        block), and must not overwrite it later."""
        self._ingest()
        rows = self._rows(block_ids, start, num_tokens)
        skip = start - context_start
        for p, lat in zip(self.pages, context):
            p.view(-1, p.shape[-1]).index_copy_(0, rows, lat[skip:].to(p.device, p.dtype))
        self._valid[rows] = context[-1][skip:].to(self.device, torch.bool)

    def _ingest(self) -> None:
        """Writes the pending context into the draft's pages, oldest first, so a slot ends up
        with its latest owner's latents (as if each step had written its own at once)."""
        if not self._pending:
            return
        hidden, positions, dest = (torch.cat(x) for x in zip(*self._pending))
        self._pending, self._pending_rows = [], 0
        uniq, inverse = dest.unique(return_inverse=True)
        if len(uniq) < len(dest):       # a slot written twice (reused block): the last write
            last = torch.full((len(uniq),), -1, dtype=torch.long, device=dest.device)
            last.scatter_reduce_(0, inverse, torch.arange(len(dest), device=dest.device),
                                 "amax")
            hidden, positions, dest = hidden[last], positions[last], dest[last]
        lats = self.draft.context_latents(hidden, positions)
        self.rows_projected += len(dest)
        for page, lat in zip(self.pages, lats):
            page.view(-1, page.shape[-1]).index_copy_(0, dest, lat.to(page.dtype))
        self._valid.index_fill_(0, dest, True)

    def _pick(self, logits: torch.Tensor, prev: torch.Tensor, rows: list[SamplingRow],
              rids: list[str]) -> dict[str, Proposal]:
        """Left to right: each draft adds the Markov bias of the one before it. The draft's
        distribution q gets the processing the target's p gets when verified (penalties over
        the history and the drafts so far, temperature, top-k/top-p/min-p), so the rejection
        sampler compares like with like."""
        B, k, _ = logits.shape
        # greedy drafting: the argmax, verified as a point mass (no q)
        random = ([] if self.greedy_drafts else
                  [i for i, r in enumerate(rows) if r.params.temperature > 0])
        tokens = torch.empty(B, k, dtype=torch.long)
        probs = torch.empty(len(random), k, logits.shape[-1]) if random else None
        prev = prev.cpu()
        logits = logits.cpu()
        # built once from each row's history, then advanced by each draft (not rebuilt per position)
        pen = Penalties.build(rows, logits.shape[-1])
        for j in range(k):
            # prev lives on the CPU (the picks are made there); the draft's tables may not
            lj = logits[:, j] + self.draft.markov_bias(prev.to(self.device)).float().cpu()
            if pen is not None:
                lj = pen.apply(lj)
            tok = lj.argmax(-1)
            if random:
                q = target_probs(lj[random], [rows[i] for i in random])
                probs[:, j] = q
                for n, i in enumerate(random):
                    tok[i] = _draw(q[n], rows[i].generator)
            tokens[:, j] = tok
            if pen is not None and j + 1 < k:
                pen.advance(tok)
            prev = tok
        out = {}
        where = {i: n for n, i in enumerate(random)}
        for i, rid in enumerate(rids):
            out[rid] = Proposal(tokens[i].tolist(), probs[where[i]] if i in where else None)
        return out
