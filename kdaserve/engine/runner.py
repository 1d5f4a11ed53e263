"""Owns the tensors: the model, the hybrid cache, per-request RNGs. One forward per step."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kdaserve.cache.planner import CachePlan
from kdaserve.engine.sampler import SamplingRow, sample
from kdaserve.model.batch import HybridCache, build_forward_batch
from kdaserve.model.kimi_linear import KimiLinearForCausalLM
from kdaserve.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from kdaserve.request import Request


class ModelRunner:
    def __init__(self, model: KimiLinearForCausalLM, plan: CachePlan,
                 device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.model = model
        self.device = torch.device(device)
        self.cfg = model.config
        self.cache = HybridCache.allocate(self.cfg, plan.num_blocks, plan.block_size,
                                          plan.num_state_slots, model.dtype, self.device,
                                          num_snapshots=plan.num_snapshots)
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        self._unseeded = torch.Generator().manual_seed(seed)
        self.num_forward_tokens = 0

    def _generator(self, req: Request) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self._unseeded
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = torch.Generator().manual_seed(seed)
        return gen

    @staticmethod
    def order(seqs: list[ScheduledSequence]) -> tuple[list[ScheduledSequence], int]:
        """Decode rows (one token with context) first, as the model's batch layout requires;
        returns the ordered sequences and the number of decode rows."""
        decode = [s for s in seqs if len(s.token_ids) == 1 and s.context_len > 0]
        rest = [s for s in seqs if not (len(s.token_ids) == 1 and s.context_len > 0)]
        return decode + rest, len(decode)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> ModelRunnerOutput:
        for rid in out.finished:
            self._generators.pop(rid, None)
        if out.is_empty:
            return ModelRunnerOutput(sampled={})
        seqs, num_decode = self.order(out.sequences)
        restores = [(s.state_slot, s.restore_snapshot) for s in seqs
                    if s.restore_snapshot is not None]
        if restores:
            self.cache.restore(torch.tensor([r[0] for r in restores], device=self.device),
                               torch.tensor([r[1] for r in restores], device=self.device))
        row = {s.request_id: i for i, s in enumerate(seqs)}
        snaps = [(row[rid], pos, sid) for rid, pos, sid in out.snapshot_requests]
        lens = [len(s.token_ids) for s in seqs]
        ends, pos = [], 0
        for s, n in zip(seqs, lens):
            pos += n
            if s.sample:
                ends.append(pos - 1)
        fb = build_forward_batch(
            lens, [s.context_len for s in seqs], num_decode=num_decode,
            conv_kernel=self.cfg.conv_kernel_size, chunk_size=self.model.chunk_size,
            cache=self.cache, block_tables=[s.block_ids for s in seqs],
            state_slots=[s.state_slot for s in seqs], logits_indices=ends,
            snapshots=snaps or None, device=self.device,
        )
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long,
                           device=self.device)
        self.num_forward_tokens += len(ids)
        logits, _ = self.model(ids, fb)
        sampling = [s for s in seqs if s.sample]
        if not sampling:
            return ModelRunnerOutput(sampled={})
        rows = []
        for s in sampling:
            req = requests[s.request_id]
            rows.append(SamplingRow(s.request_id, req.sampling_params, req.prompt_token_ids,
                                    req.output_token_ids, self._generator(req)))
        tokens = sample(logits.cpu(), rows)
        return ModelRunnerOutput(sampled={s.request_id: t for s, t in zip(sampling, tokens)})
