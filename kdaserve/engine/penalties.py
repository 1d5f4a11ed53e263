"""Repetition, frequency and presence penalties as [P, V] state on the logits' device, and the
one way Python lists reach a device here (`device_tensor`: pinned, asynchronous, no wait).

Repetition divides positive logits (multiplies negative ones) of tokens seen in prompt or
output; frequency and presence subtract count-proportional and flat amounts for tokens of the
output. The state is built once per step from each row's history (one scatter for the whole
batch), then advanced token by token (the drafts of speculative decoding) or expanded to the
verified positions, so that penalising another position costs a few vector ops. Nothing here
reads a tensor back: the row numbers stay Python lists beside their tensors.

Legend: P penalised rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kdaserve.request import SamplingParams

if TYPE_CHECKING:
    from kdaserve.engine.sampler import SamplingRow


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | None
                  ) -> torch.Tensor:
    """A Python list as a tensor on `device`. To CUDA through pinned memory without waiting:
    a plain copy would wait for the stream, i.e. for the forward still running."""
    t = torch.tensor(values, dtype=dtype)
    if device is None or device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def penalised(params: SamplingParams) -> bool:
    return params.penalised


@dataclass
class Penalties:
    """The penalised rows of a logits batch (see the module docstring)."""

    index: torch.Tensor        # [P] the penalised rows' numbers in the logits batch
    seen: torch.Tensor         # [P, V] bool
    counts: torch.Tensor       # [P, V] float32
    rep: torch.Tensor          # [P, 1]
    freq: torch.Tensor         # [P, 1]
    pres: torch.Tensor         # [P, 1]
    rows: list[int]            # index, as a list (never read back from the device)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab: int,
              device: torch.device | None = None) -> Penalties | None:
        pen = [i for i, r in enumerate(rows) if penalised(r.params)]
        if not pen:
            return None
        out_at: list[int] = []
        out_tok: list[int] = []
        seen_at: list[int] = []
        seen_tok: list[int] = []
        for n, i in enumerate(pen):
            r = rows[i]
            out_at += [n] * len(r.output_token_ids)
            out_tok += r.output_token_ids
            if r.params.repetition_penalty != 1.0:
                seen_at += [n] * len(r.prompt_token_ids)
                seen_tok += r.prompt_token_ids
        ids = device_tensor([out_at + seen_at, out_tok + seen_tok], torch.long, device)
        ids[1].clamp_(max=vocab - 1)
        dev = ids.device
        n_out = len(out_at)
        counts = torch.zeros(len(pen), vocab, device=dev).index_put_(
            (ids[0, :n_out], ids[1, :n_out]), torch.ones(n_out, device=dev), accumulate=True)
        seen = torch.zeros(len(pen), vocab, dtype=torch.bool, device=dev)
        seen[ids[0, n_out:], ids[1, n_out:]] = True
        seen |= counts > 0
        cols = device_tensor([[float(rows[i].params.repetition_penalty),
                               float(rows[i].params.frequency_penalty),
                               float(rows[i].params.presence_penalty)] for i in pen],
                             torch.float32, device)
        return cls(device_tensor(pen, torch.long, device), seen, counts, cols[:, 0:1],
                   cols[:, 1:2], cols[:, 2:3], pen)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A penalised copy of logits [S, V] (float32)."""
        logits = logits.clone()
        sub = logits[self.index]
        sub = torch.where(self.seen, torch.where(sub > 0, sub / self.rep, sub * self.rep), sub)
        logits[self.index] = sub - (self.freq * self.counts
                                    + self.pres * (self.counts > 0).to(sub))
        return logits

    def advance(self, tokens: torch.Tensor) -> None:
        """Each row of the batch appended tokens[row] to its output."""
        t = tokens[self.index].clamp(max=self.counts.shape[-1] - 1)
        rows = torch.arange(len(self.rows), device=self.counts.device)
        self.counts[rows, t] += 1
        self.seen[rows, t] = True

    def positions(self, drafts: list[list[int]]) -> Penalties:
        """The state at every verified position: row i becomes len(drafts[i]) + 1 rows, where
        row j has also seen drafts[i][:j] (positions packed back to back, as in verify)."""
        starts, pos = [], 0
        for d in drafts:
            starts.append(pos)
            pos += len(d) + 1
        idx: list[int] = []
        src: list[int] = []
        at: list[int] = []              # (expanded row, draft token) pairs to count
        tok: list[int] = []
        for n, i in enumerate(self.rows):
            d = drafts[i]
            base = len(idx)
            idx += range(starts[i], starts[i] + len(d) + 1)
            src += [n] * (len(d) + 1)
            for j in range(1, len(d) + 1):
                at += [base + j] * j
                tok += d[:j]
        dev = self.counts.device
        lists = device_tensor([src, idx], torch.long, dev)
        s = lists[0]
        counts, seen = self.counts[s], self.seen[s]
        if at:
            extra = device_tensor([at, tok], torch.long, dev)
            extra[1].clamp_(max=counts.shape[-1] - 1)
            counts.index_put_((extra[0], extra[1]), torch.ones(len(at), device=dev),
                              accumulate=True)
            seen[extra[0], extra[1]] = True
        return Penalties(lists[1], seen, counts, self.rep[s], self.freq[s], self.pres[s], idx)
