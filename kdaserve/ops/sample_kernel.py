"""The compiled sampler (csrc/sample_cpu.c): penalties, temperature, top-k, top-p, min-p and
the draw of a batch of rows in one call, for kdaserve.engine.sampler.sample, whose torch form
stays the reference (tests/ops/test_sample_kernel.py). A row's history reaches C as one
int32 array per call (prompt ids, then output ids), only for rows that are penalised."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from functools import cache

import torch

from kdaserve.ops.cpu_kernels import _I64, _PTR, _c_function, _openmp_built, _ptr

# rows x vocabulary below which one thread samples them all: a sampled row of 4,096 costs
# ~50 us, an OpenMP hand-off on torch's spinning workers a few
_PARALLEL_MIN = 4 * 4096
_CAND_BYTES = 8                       # struct { float v; int32 i; }

SampleRows = Callable[..., torch.Tensor]


@cache
def sample_rows_kernel() -> SampleRows | None:
    """The compiled sampler, or None (no compiler, disabled, build failed)."""
    fn = _c_function("sample_cpu.c", "sample_rows_threads",
                     [_I64, _I64, _I64] + [_PTR] * 14 + [_I64])
    if fn is None:
        return None
    split = _openmp_built("sample_cpu.c")       # else one thread takes every row

    def run(logits: torch.Tensor, temps: Sequence[float], top_k: Sequence[int],
            top_p: Sequence[float], min_p: Sequence[float], uniforms: Sequence[float],
            penalties: Sequence[tuple[float, float, float]],
            histories: Sequence[tuple[Sequence[int], Sequence[int]] | None]) -> torch.Tensor:
        """logits [S, V] fp32 (penalised here, constrained already); per row: temperature
        (0: greedy), top_k (V or more: off), top_p, min_p, its uniform in [0, 1) (ignored when
        greedy), (repetition, frequency, presence), and (prompt ids, output ids) where
        penalised (else None; the prompt ids matter only with a repetition penalty).
        Returns the tokens [S] int64."""
        S, V = logits.shape
        logits = logits.float().contiguous()
        f32 = [torch.tensor(v, dtype=torch.float32) for v in (
            temps, top_p, min_p, uniforms, [p[0] for p in penalties],
            [p[1] for p in penalties], [p[2] for p in penalties])]
        hist, off, n_prompt = array("i"), array("q", [0]), array("q")
        for h in histories:
            if h is not None:
                prompt, output = h
                hist.extend(prompt)
                n_prompt.append(len(prompt))
                hist.extend(output)
            else:
                n_prompt.append(0)
            off.append(len(hist))
        hist_t = (torch.frombuffer(hist, dtype=torch.int32) if len(hist)
                  else torch.zeros(1, dtype=torch.int32))
        off_t = torch.frombuffer(off, dtype=torch.int64)
        np_t = torch.frombuffer(n_prompt, dtype=torch.int64)
        k_t = torch.tensor(top_k, dtype=torch.int64).clamp_(max=V)
        out = torch.empty(S, dtype=torch.int64)
        parts = min(torch.get_num_threads(), S) if split and S * V >= _PARALLEL_MIN else 1
        # per part: the row (V floats), candidates (V), counts (V floats), marks (V bytes)
        row_bytes = (V * (4 + _CAND_BYTES + 4) + V + 63) // 64 * 64
        scratch = torch.empty(parts, row_bytes, dtype=torch.uint8)
        scratch[:, V * (4 + _CAND_BYTES):].zero_()
        fn(S, parts, V, _ptr(logits), _ptr(f32[0]), _ptr(k_t), *(_ptr(t) for t in f32[1:]),
           _ptr(hist_t), _ptr(off_t), _ptr(np_t), _ptr(out), _ptr(scratch), row_bytes)
        return out

    return run


RowProbs = Callable[[torch.Tensor, Sequence[int], Sequence[float], Sequence[float]],
                    torch.Tensor]


@cache
def row_probs_kernel() -> RowProbs | None:
    """The compiled form of speculative decoding's distributions (csrc/sample_probs.h), or
    None (no compiler, disabled, build failed)."""
    fn = _c_function("sample_cpu.c", "row_probs_threads", [_I64, _I64, _I64] + [_PTR] * 6
                     + [_I64])
    if fn is None:
        return None
    split = _openmp_built("sample_cpu.c")

    def run(x: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float],
            min_p: Sequence[float]) -> torch.Tensor:
        """x [S, V] fp32 (penalised, masked and divided by the temperature already); per row
        top_k (V or more: off), top_p and min_p. Returns the probabilities [S, V]."""
        S, V = x.shape
        x = x.float().contiguous()
        k_t = torch.tensor(top_k, dtype=torch.int64).clamp_(max=V)
        p_t = torch.tensor(top_p, dtype=torch.float32)
        m_t = torch.tensor(min_p, dtype=torch.float32)
        out = torch.empty(S, V, dtype=torch.float32)
        parts = min(torch.get_num_threads(), S) if split and S * V >= _PARALLEL_MIN else 1
        stride = (V * (_CAND_BYTES + 4) + 63) // 64 * 64     # candidates, then V floats
        scratch = torch.empty(parts, stride, dtype=torch.uint8)
        scratch[:, V * _CAND_BYTES:].zero_()
        fn(S, parts, V, _ptr(x), _ptr(k_t), _ptr(p_t), _ptr(m_t), _ptr(out), _ptr(scratch),
           stride)
        return out

    return run
