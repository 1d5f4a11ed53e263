"""One place that picks the implementation of each op for a device.

The torch reference (`kdaserve.ops.kda`) runs everywhere and is what the tests check against
fla-core's naive functions. On CUDA, when fla-core (and triton) are installed, its Triton KDA
kernels take the chunked prefill and our Triton kernel (`ops/gpu/kda_decode.py`) the decode rows
on the state slots. On CPU, when a C compiler is present, a compiled recurrence
(`ops/cpu_kernels.py`) runs decode rows in place on the state slots and prefill rows too (it
keeps the chunk-end states the chunked op returns for snapshots): with the state held in L1 it
is several times faster than the torch chunked form. Set
KDASERVE_KDA_BACKEND=torch to force the reference everywhere (KDASERVE_TRITON=0: no Triton
kernel of ours, fla's prefill stays).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import torch

from kdaserve.ops import gpu
from kdaserve.ops import kda as kda_ref


@dataclass(frozen=True)
class KDAOps:
    name: str
    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    # decode rows in place on the state slots: (store, slots, q, k, v, g, beta, keep_states,
    # scratch) -> (o [B,L,H,V], states after each position or None)
    recurrent_slots: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    # the recurrence's inputs from the layer's projections in one call (conv, SiLU, norms,
    # decay, beta; see cpu_kernels.kda_prepare_kernel), or None: the layer's torch ops
    prepare: Callable[..., tuple[torch.Tensor, ...]] | None = None


TORCH_KDA = KDAOps("torch", kda_ref.kda_chunk, kda_ref.kda_recurrent_slots)


def _compiled_recurrent_slots(kernel):
    def recurrent_slots(store, slots, q, k, v, g, beta, keep_states=False, scratch=None):
        B, L, H, K = q.shape
        kept = (torch.empty(B, L, H, K, v.shape[-1], dtype=torch.float32)
                if keep_states else None)
        return kernel(store, slots, q, k, v, g, beta, kept), kept

    return recurrent_slots


def _compiled_chunk(kernel):
    """The chunked op's contract (chunk-end states for snapshots) through the recurrence."""
    def chunk(q, k, v, g, beta, state, chunk_size, keep_chunk_states=False):
        B, L, H, K = q.shape
        s = state.to(torch.float32).contiguous().clone()
        kept = (torch.empty(B, L // chunk_size, H, K, v.shape[-1], dtype=torch.float32)
                if keep_chunk_states else None)
        slots = torch.arange(B, dtype=torch.long)
        o = kernel(s, slots, q.float(), k.float(), v.float(), g.float(), beta.float(), kept,
                   keep_every=chunk_size)
        return o, s, kept

    return chunk


@cache
def _cpu_ops() -> KDAOps:
    if os.environ.get("KDASERVE_KDA_BACKEND", "auto") == "torch":
        return TORCH_KDA
    from kdaserve.ops.cpu_kernels import kda_prepare_kernel, kda_recurrent_slots_kernel

    kernel = kda_recurrent_slots_kernel()
    if kernel is None:
        return TORCH_KDA
    return KDAOps("c", _compiled_chunk(kernel), _compiled_recurrent_slots(kernel),
                  kda_prepare_kernel())


def _fla_chunk_factory() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    from fla.ops.kda import chunk_kda  # type: ignore[import-not-found]

    def chunk(q, k, v, g, beta, state, chunk_size, keep_chunk_states=False):
        if keep_chunk_states:  # the Triton kernel does not expose per-chunk states here
            return kda_ref.kda_chunk(q, k, v, g, beta, state, chunk_size, True)
        o, s = chunk_kda(q, k, v, g.float(), beta.float(), scale=1.0,
                         initial_state=state.float(), output_final_state=True)
        return o.float(), s.float(), None

    return chunk


def _triton_recurrent_slots() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    from kdaserve.ops.gpu.kda_decode import kda_recurrent_slots_triton

    return kda_recurrent_slots_triton


@cache
def _cuda_ops() -> KDAOps:
    """fla-core's chunked kernel for prefill, our Triton kernel for decode on the slots (sync
    free, capturable in a CUDA graph); the references where either is missing."""
    if os.environ.get("KDASERVE_KDA_BACKEND", "auto") == "torch":
        return TORCH_KDA
    decode, name = kda_ref.kda_recurrent_slots, ""
    if gpu.kernels_for("cuda"):
        decode, name = _triton_recurrent_slots(), "+triton-decode"
    try:
        chunk, name = _fla_chunk_factory(), "fla-triton" + name
    except Exception:  # fla-core or triton missing: the reference is always correct
        chunk, name = kda_ref.kda_chunk, "torch" + name
    if chunk is kda_ref.kda_chunk and decode is kda_ref.kda_recurrent_slots:
        return TORCH_KDA
    return KDAOps(name, chunk, decode)


@cache
def _cuda_grad_ops() -> KDAOps:
    """Training: our decode kernel has no autograd, the reference's torch ops do."""
    ops = _cuda_ops()
    return replace(ops, recurrent_slots=kda_ref.kda_recurrent_slots)


@cache
def _interpreted_ops() -> KDAOps:
    """CPU under Triton's interpreter (tests/ops/gpu): the CPU prefill, the Triton decode."""
    cpu = _cpu_ops()
    return KDAOps(cpu.name + "+triton-decode", cpu.chunk, _triton_recurrent_slots(), cpu.prepare)


def kda_ops(device: torch.device, needs_grad: bool = False) -> KDAOps:
    """needs_grad: the forward is being trained; the compiled CPU kernels have no autograd
    (fla's Triton kernels do)."""
    if needs_grad and device.type != "cuda":
        return TORCH_KDA
    if device.type == "cuda":
        return _cuda_grad_ops() if needs_grad else _cuda_ops()
    return _interpreted_ops() if gpu.kernels_for(device.type) else _cpu_ops()
