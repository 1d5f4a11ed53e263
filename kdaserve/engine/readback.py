"""The one copy of a step's sampled results from the device to the host.

Everything sampling leaves on the device (tokens, accepted counts, logprobs) is packed into one
float64 buffer (token ids and float32 logprobs are exact in it), copied once, asynchronously,
into pinned host memory, with an event behind it: the host goes on (the scheduler plans the
next step) and waits only when it reads the results. On CPU tensors the copy is the tensor.
"""

from __future__ import annotations

import math

import torch

from kdaserve.outputs import SampledToken


class Readback:
    def __init__(self, parts: list[torch.Tensor]) -> None:
        self._shapes = [tuple(p.shape) for p in parts]
        self._dtypes = [p.dtype for p in parts]
        flat = (torch.cat([p.reshape(-1).to(torch.float64) for p in parts]) if parts
                else torch.zeros(0, dtype=torch.float64))
        self._event = None
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        """The parts on the host, in their shapes and dtypes (blocks until the copy is done)."""
        if self._event is not None:
            self._event.synchronize()
        out, at = [], 0
        for shape, dtype in zip(self._shapes, self._dtypes):
            n = math.prod(shape)
            out.append(self._host[at:at + n].view(shape).to(dtype))
            at += n
        return out


def sampled_tokens(tokens: list[int], want: int | None, chosen: list[float] | None,
                   top_values: list[list[float]] | None, top_ids: list[list[int]] | None
                   ) -> list[SampledToken]:
    """One row's tokens with the logprobs it asked for (sampler._top_logprobs's form: the
    chosen token first, then the top `want` that are not it)."""
    if want is None or chosen is None:
        return [SampledToken(t) for t in tokens]
    out = []
    for j, t in enumerate(tokens):
        d = {t: chosen[j]}
        if want and top_ids is not None and top_values is not None:
            for tid, lp in zip(top_ids[j][:want], top_values[j][:want]):
                d.setdefault(tid, lp)
        out.append(SampledToken(t, chosen[j], d))
    return out
