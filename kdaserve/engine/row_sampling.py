"""Sampling a step's rows: plain rows through the sampler, verify rows (a token and its drafts)
through the rejection sampler, each with its request's own generator, and the draft
probabilities a probabilistic proposer left for the next verification.

Logits on the host go through the CPU forms (the compiled sampler, rejection.verify); logits
on a device are sampled there (device_sampling.py, spec/device_rejection.py) and come back
in one asynchronous copy (readback.py): `sample_async` returns at once, the caller reads the
tokens from the `PendingSample` when it needs them. The same tokens either way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from kdaserve.engine.device_sampling import sample_on_device, wanted_logprobs
from kdaserve.engine.penalties import device_tensor
from kdaserve.engine.readback import Readback, sampled_tokens
from kdaserve.engine.sampler import SamplingRow, sample
from kdaserve.engine.spec.device_rejection import verify_on_device
from kdaserve.engine.spec.rejection import VerifyRow, verify
from kdaserve.engine.step_message import RunnerRequest
from kdaserve.outputs import SampledToken, ScheduledSequence


class PendingSample:
    """A step's sampled tokens on their way to the host; `result()` waits for the copy."""

    def __init__(self, plain: list[SamplingRow], ver: list[VerifyRow],
                 readback: Readback | None, ready: dict[str, list[SampledToken]] | None = None
                 ) -> None:
        self._plain, self._ver, self._readback = plain, ver, readback
        self._result = ready

    def result(self) -> dict[str, list[SampledToken]]:
        if self._result is None:
            self._result = self._unpack(self._readback.wait()) if self._readback else {}
        return self._result

    def _unpack(self, parts: list[torch.Tensor]) -> dict[str, list[SampledToken]]:
        """parts: the plain rows' tokens [S] (then chosen logprobs, top values, top ids when
        a row wants logprobs), then the verify rows' tokens [R, N+1], counts [R] (then the
        same three at [R, N+1])."""
        out: dict[str, list[SampledToken]] = {}
        none = (None, None, None)
        if self._plain:
            n = 4 if wanted_logprobs(self._plain) is not None else 1
            tokens, lp = parts[0].tolist(), [p.tolist() for p in parts[1:n]]
            parts = parts[n:]
            for i, (r, t) in enumerate(zip(self._plain, tokens)):
                chosen, vals, ids = ([x[i]] for x in lp) if lp else none
                out[r.request_id] = sampled_tokens([t], r.params.logprobs, chosen, vals, ids)
        if self._ver:
            n = 5 if wanted_logprobs([v.row for v in self._ver]) is not None else 2
            tokens, counts = parts[0].tolist(), parts[1].tolist()
            lp = [p.tolist() for p in parts[2:n]]
            for i, v in enumerate(self._ver):
                chosen, vals, ids = (x[i] for x in lp) if lp else none
                out[v.row.request_id] = sampled_tokens(tokens[i][:counts[i]],
                                                       v.row.params.logprobs, chosen, vals, ids)
        return out


class RowSampler:
    def __init__(self, seed: int, on_device: bool | None = None) -> None:
        """on_device: sample where the logits are (None: on the host for CPU logits, on the
        device otherwise; True: the device form on CPU tensors too, as the tests run it).
        KDASERVE_DEVICE_SAMPLING=1 / =0 stands for True / False when it is None."""
        if on_device is None and os.environ.get("KDASERVE_DEVICE_SAMPLING", "") in ("0", "1"):
            on_device = os.environ["KDASERVE_DEVICE_SAMPLING"] == "1"
        self._generators: dict[str, torch.Generator] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}
        self._unseeded = torch.Generator().manual_seed(seed)
        self.on_device = on_device
        # verify drafted blocks with block verification (spec/block_verify.py; the engine's
        # default, set by the runner builder), else token by token
        self.block_verification = False

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._draft_probs.pop(request_id, None)

    def keep_draft_probs(self, request_id: str, probs: torch.Tensor | None) -> None:
        """The proposer's probabilities of the drafts it just made (None: point masses)."""
        if probs is not None:
            self._draft_probs[request_id] = probs
        else:
            self._draft_probs.pop(request_id, None)

    def _generator(self, req: RunnerRequest) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self._unseeded
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = torch.Generator().manual_seed(seed)
        return gen

    def row(self, req: RunnerRequest) -> SamplingRow:
        return SamplingRow(req.request_id, req.sampling_params, req.prompt_token_ids,
                           req.output_token_ids, self._generator(req))

    def _split(self, seqs: Sequence[ScheduledSequence], requests: Mapping[str, RunnerRequest],
               masks: Mapping[str, torch.Tensor]):
        """(plain positions, plain rows, verify positions, verify rows) in forward order."""
        plain_idx, plain_rows, ver_idx, ver_rows = [], [], [], []
        at = 0
        for s in seqs:
            if s.num_draft_tokens:
                n = s.num_draft_tokens + 1
                ver_idx.extend(range(at, at + n))
                probs = self._draft_probs.pop(s.request_id, None)
                if probs is not None:
                    probs = probs[: s.num_draft_tokens]
                ver_rows.append(VerifyRow(self.row(requests[s.request_id]),
                                          list(s.token_ids[1:]), probs,
                                          masks.get(s.request_id), self.block_verification))
                at += n
            elif s.sample:
                plain_idx.append(at)
                plain_rows.append(self.row(requests[s.request_id]))
                if s.request_id in masks:
                    plain_rows[-1].bitmask = masks[s.request_id][0]
                at += 1
        return plain_idx, plain_rows, ver_idx, ver_rows

    def sample(self, seqs: Sequence[ScheduledSequence], logits: torch.Tensor,
               requests: Mapping[str, RunnerRequest],
               masks: Mapping[str, torch.Tensor] | None = None,
               ) -> dict[str, list[SampledToken]]:
        """logits: the wanted rows in forward order (all positions of verify rows).
        masks: grammar bitmasks [positions, W] of the constrained requests."""
        return self.sample_async(seqs, logits, requests, masks).result()

    def sample_async(self, seqs: Sequence[ScheduledSequence], logits: torch.Tensor,
                     requests: Mapping[str, RunnerRequest],
                     masks: Mapping[str, torch.Tensor] | None = None) -> PendingSample:
        """As sample; on the device form nothing waits for the device: the uniforms are drawn
        on the host, the work is queued, and the results come back in one async copy."""
        on_device = (self.on_device if self.on_device is not None
                     else logits.device.type != "cpu")
        if not on_device and not masks and all(
                s.sample and not s.num_draft_tokens and requests[s.request_id].argmax_only
                for s in seqs):
            # every row an argmax, one logits row each in order: what sample() computes for
            # them, without building its rows (~10 us a row in the engine's loop)
            rows = logits[:len(seqs)]
            # numpy's argmax where it can: torch's took 9 us at one row of 4,096 and 88 at 32
            # (its threads), numpy's 2 and 15; both return the first of equal maxima, a NaN
            # counting as the largest
            tokens = (rows.numpy().argmax(-1) if rows.dtype == torch.float32
                      else rows.argmax(-1)).tolist()
            return PendingSample([], [], None, {s.request_id: [SampledToken(t)]
                                                for s, t in zip(seqs, tokens)})
        plain_idx, plain_rows, ver_idx, ver_rows = self._split(seqs, requests, masks or {})
        if on_device:
            dev = logits.device
            parts: list[torch.Tensor] = []
            # plain rows first, then verify rows: the order the host forms draw uniforms in
            if plain_rows:
                parts += sample_on_device(logits[_index(plain_idx, dev)], plain_rows).tensors()
            if ver_rows:
                parts += verify_on_device(logits[_index(ver_idx, dev)], ver_rows).tensors()
            return PendingSample(plain_rows, ver_rows, Readback(parts) if parts else None)
        out: dict[str, list[SampledToken]] = {}
        if plain_rows:       # (a slice where it can: a list index costs ~80 us a step)
            tokens = sample(logits[_index(plain_idx, logits.device)], plain_rows)
            out.update({r.request_id: [t] for r, t in zip(plain_rows, tokens)})
        if ver_rows:
            tokens = verify(logits[_index(ver_idx, logits.device)], ver_rows)
            out.update({v.row.request_id: t for v, t in zip(ver_rows, tokens)})
        return PendingSample(plain_rows, ver_rows, None, out)


def _index(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    """Rows of the logits: a slice when contiguous from 0 (no copy), else an index tensor."""
    if rows == list(range(len(rows))):
        return slice(0, len(rows))
    return device_tensor(rows, torch.long, device)
