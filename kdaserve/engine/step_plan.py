"""The plan of one forward: the step's rows in forward order, the logits rows wanted, and the
layout that the chosen forward reads (the fused CPU decoder's rows, or the torch forward's
`ForwardBatch`). Built by the runner from the step's sequences and the snapshots its cache
operations ask the forward to take; each pipeline stage builds the same plan from the same
message."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kdaserve.engine.cache_ops import StepOps
from kdaserve.engine.decode_graphs import DecodeGraphs
from kdaserve.engine.decode_inputs import DecodeInputs
from kdaserve.engine.prompt_logprob_scoring import PromptRows, plan_rows
from kdaserve.engine.step_message import RunnerRequest
from kdaserve.model import fused_decode
from kdaserve.model.batch import ForwardBatch, build_forward_batch
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.layout.snapshots import SnapshotAt
from kdaserve.outputs import ScheduledSequence


@dataclass
class StepPlan:
    seqs: list[ScheduledSequence]           # in forward order: decode rows first
    num_decode: int
    lens: list[int]
    starts: list[int]                       # each row's first token in the flat batch
    n_sample: int                           # logits rows that are sampled (the rest: prompt)
    prompt_rows: list[PromptRows]
    snapshots: list[SnapshotAt]             # taken by the forward (not on verify rows)
    ids: torch.Tensor | None               # [T] the step's tokens (None: fused, RowInputs)
    wanted: list[int]                       # rows whose logits are wanted, sampled first
    fb: ForwardBatch | None                 # the torch forward's layout (None: fused)
    fused: fused_decode.FusedDecoder | None  # the fused CPU decoder, when it takes the step
    graph: int | None = None                # the captured decode graph's batch size, if one

    @property
    def verifying(self) -> bool:
        return any(s.num_draft_tokens for s in self.seqs)


def forward_order(seqs: Sequence[ScheduledSequence]) -> tuple[list[ScheduledSequence], int]:
    """Decode rows first, as the model's batch layout requires; the rows and their number."""
    decode = [s for s in seqs if s.is_decode]
    return decode + [s for s in seqs if not s.is_decode], len(decode)


def plan_step(sequences: Sequence[ScheduledSequence], ops: StepOps,
              requests: Mapping[str, RunnerRequest], cache: HybridCache, conv_kernel: int,
              chunk_size: int, device: torch.device,
              fused_for: Callable[[list[ScheduledSequence], int],
                                  fused_decode.FusedDecoder | None],
              decode_inputs: DecodeInputs | None = None,
              graphs: DecodeGraphs | None = None) -> StepPlan | None:
    """The plan for the sequences that run (None: every one sits the step out).
    `decode_inputs`: a step of one-token decode rows that the torch forward runs is laid out
    from these persistent buffers, without waiting on the device (decode_inputs.py); with
    `graphs`, such a step is replayed from a captured graph where one holds it."""
    seqs, num_decode = forward_order([s for s in sequences if s.request_id not in ops.lost])
    if not seqs:
        return None
    snapshots = ops.takes_for({s.request_id: b for b, s in enumerate(seqs)})
    lens = [len(s.token_ids) for s in seqs]
    wanted, starts, pos = [], [], 0
    for s, n in zip(seqs, lens):
        starts.append(pos)
        if s.num_draft_tokens:
            wanted.extend(range(pos, pos + n))
        elif s.sample:
            wanted.append(pos + n - 1)
        pos += n
    prompt_rows = plan_rows(seqs, starts, requests)       # only requests that ask
    n_sample = len(wanted)
    for r in prompt_rows:
        wanted.extend(r.at)
    fused = fused_for(seqs, num_decode) if not prompt_rows else None
    resident = (fused is None and decode_inputs is not None and num_decode == len(seqs)
                and all(n == 1 for n in lens) and not any(s.media for s in seqs))
    graph = (graphs.size_for(len(seqs)) if resident and graphs is not None
             and all(a.position == seqs[a.row].context_len + 1 for a in snapshots) else None)
    if graph is not None:
        graphs.fill(seqs, graph)
        return StepPlan(seqs, num_decode, lens, starts, n_sample, prompt_rows, snapshots,
                        decode_inputs.vectors[0, :len(seqs)], wanted, None, None, graph)
    inp = decode_inputs.fill(seqs) if resident else None
    fb = None if fused is not None else build_forward_batch(
        lens, [s.context_len for s in seqs], num_decode=num_decode, conv_kernel=conv_kernel,
        chunk_size=chunk_size, cache=cache,
        block_tables=inp.block_table if inp else [s.block_ids for s in seqs],
        state_slots=inp.slots if inp else [s.state_slot for s in seqs],
        logits_indices=wanted, snapshots=snapshots or None, device=device,
        positions=inp.positions if inp else None, sync_free=inp is not None)
    # a fused step takes its ids with its other row inputs (fused_rows.RowInputs)
    ids = inp.ids if inp else None if fused is not None else torch.tensor(
        [t for s in seqs for t in s.token_ids], dtype=torch.long, device=device)
    return StepPlan(seqs, num_decode, lens, starts, n_sample, prompt_rows, snapshots, ids,
                    wanted, fb, fused)
