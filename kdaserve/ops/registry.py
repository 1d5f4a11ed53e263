"""One place that picks the implementation of each op for a device.

The torch reference (`kdaserve.ops.kda`) runs everywhere and is what the tests check against
fla-core's naive functions. On CUDA, when fla-core (and triton) are installed, its Triton KDA
kernels take the chunked prefill; set KDASERVE_KDA_BACKEND=torch to force the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from kdaserve.ops import kda as kda_ref


@dataclass(frozen=True)
class KDAOps:
    name: str
    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    step: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    recurrent: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


TORCH_KDA = KDAOps("torch", kda_ref.kda_chunk, kda_ref.kda_step, kda_ref.kda_recurrent)


def _fla_chunk_factory() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    from fla.ops.kda import chunk_kda  # type: ignore[import-not-found]

    def chunk(q, k, v, g, beta, state, chunk_size, keep_chunk_states=False):
        if keep_chunk_states:  # the Triton kernel does not expose per-chunk states here
            return kda_ref.kda_chunk(q, k, v, g, beta, state, chunk_size, True)
        o, s = chunk_kda(q, k, v, g.float(), beta.float(), scale=1.0,
                         initial_state=state.float(), output_final_state=True)
        return o.float(), s.float(), None

    return chunk


@lru_cache(maxsize=None)
def _cuda_ops() -> KDAOps:
    if os.environ.get("KDASERVE_KDA_BACKEND", "auto") == "torch":
        return TORCH_KDA
    try:
        chunk = _fla_chunk_factory()
    except Exception:  # fla-core or triton missing: the reference is always correct
        return TORCH_KDA
    return KDAOps("fla-triton", chunk, kda_ref.kda_step, kda_ref.kda_recurrent)


def kda_ops(device: torch.device) -> KDAOps:
    return _cuda_ops() if device.type == "cuda" else TORCH_KDA
