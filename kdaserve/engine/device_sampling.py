"""Sampling on the logits' device (CUDA): the torch form of kdaserve/engine/sampler.py rewritten
so that nothing is read back to the host before the one copy of the results.

The same tokens as the reference (sampler._sample_torch), by construction: the same processing
in the same order (penalties, logit_bias, grammar masks, temperature, top-k/top-p, min-p), the
same inverse-CDF draw, and the same uniforms: each random row's uniform still comes from its
request's host generator (one torch.rand(1) per row, in row order, as the reference draws it)
and travels to the device with the per-row parameters, built once per batch from Python lists.
Every branch is decided from those lists, never from a tensor; the nucleus comes from one full
sort (the reference narrows the candidates first, which needs read-backs; the set is the same).

Legend: S rows to sample, V vocabulary, W bitmask words, K top logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.engine.penalties import Penalties, device_tensor
from kdaserve.engine.sampler import SamplingRow, _filter, draw_rows
from kdaserve.structured import bitmask as token_bitmask


def host_uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform per row from its own stream, on the host, in order ([R] float32): what
    sampler._uniform draws, without turning it into a Python float."""
    if not generators:
        return torch.zeros(0)
    return torch.cat([torch.rand(1, generator=g) for g in generators])


def disallowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [S, W] int32 (bit i of word i // 32 set: allowed) -> [S, V] float32, 1 where
    disallowed; bitmask.disallowed's unpacking done with shifts on the mask's device."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                            # [S, W, 32]
    return (1 - bits).reshape(bitmask.shape[0], -1)[:, :vocab].to(torch.float32)


def constrain(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logit_bias, then the grammar masks, where a row has them (sampler._constrain)."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    masked = [i for i, r in enumerate(rows) if r.bitmask is not None]
    if not biased and not masked:
        return logits
    logits = logits.clone()
    V = logits.shape[-1]
    dev = logits.device
    at, tok, bias = [], [], []
    for i in biased:    # ids past the vocabulary are refused at the API edge; ignored here
        for t, b in rows[i].params.logit_bias.items():
            if 0 <= t < V:
                at.append(i)
                tok.append(t)
                bias.append(b)
    if at:
        where = device_tensor([at, tok], torch.long, dev)
        logits[where[0], where[1]] += device_tensor(bias, torch.float32, dev)
    if masked:
        masks = torch.stack([rows[i].bitmask for i in masked])
        bits = disallowed(masks.pin_memory().to(dev, non_blocking=True)
                          if dev.type == "cuda" else masks, V)
        sel = device_tensor(masked, torch.long, dev)
        logits[sel] = logits[sel].add_(bits, alpha=token_bitmask.DISALLOWED)
    return logits


def process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalties, then constraints: [S, V] float32 on the logits' device."""
    pen = Penalties.build(rows, logits.shape[-1], logits.device)
    if pen is not None:
        logits = pen.apply(logits)
    return constrain(logits, rows)


def sample_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits [S, V] (any float dtype, any device) -> tokens [S] int64 on that device."""
    logits = process(logits.float(), rows)
    tokens = logits.argmax(-1)
    rand = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    if rand:
        dev = logits.device
        idx = device_tensor(rand, torch.long, dev)
        temps = device_tensor([rows[i].params.temperature for i in rand], torch.float32, dev)
        sub = _filter(logits[idx] / temps[:, None], [rows[i] for i in rand], sort_all=True)
        u = host_uniforms([rows[i].generator for i in rand])
        u = u.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else u
        tokens = tokens.index_put((idx,), draw_rows(sub.softmax(-1), u))
    return tokens


@dataclass
class LogprobParts:
    """Logprobs of chosen tokens on the device: chosen [..], top values/ids [.., K]."""

    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    @classmethod
    def of(cls, raw_logprobs: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
           k: int) -> LogprobParts:
        """raw_logprobs [P, V]; positions and tokens of the same shape [..] (int64)."""
        lp = raw_logprobs[positions]                                         # [.., V]
        chosen = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if k:
            top = lp.topk(k, -1)
            return cls(chosen, top.values, top.indices)
        empty = chosen.new_zeros(*chosen.shape, 0)
        return cls(chosen, empty, empty.long())

    def tensors(self) -> list[torch.Tensor]:
        return [self.chosen, self.top_values, self.top_ids]


def wanted_logprobs(rows: list[SamplingRow]) -> int | None:
    """None when no row asks for logprobs, else the most top logprobs a row asks for."""
    want = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    return max(want) if want else None


@dataclass
class PlainDraw:
    """A batch of plain rows sampled on the device: tokens [S] and their logprobs."""

    tokens: torch.Tensor
    logprobs: LogprobParts | None

    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens] + (self.logprobs.tensors() if self.logprobs else [])


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow]) -> PlainDraw:
    """sampler.sample's work for the rows, left on the device (read with engine/readback.py)."""
    logits = logits.float()
    k = wanted_logprobs(rows)
    raw = logits.log_softmax(-1) if k is not None else None
    tokens = sample_tokens(logits, rows)
    parts = None
    if raw is not None:
        pos = torch.arange(len(rows), device=logits.device)
        parts = LogprobParts.of(raw, pos, tokens, k)
    return PlainDraw(tokens, parts)
