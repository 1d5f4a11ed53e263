"""Linear layers over K-major weights on the CPU: the torch forms' projections (prefill,
mixed steps, the unfused decode) through the compiled outer-product product of
csrc/row_products.h, which the fused decode blocks use too.

Why: the CPU wheel's BLAS (MKL) runs fp32 matrix products on this kind of AMD processor at
~70-90 GFLOPS a thread, where the outer-product tiles reach ~180 (docs/benchmarks.md); a
prefill spends about half its time in these products. The weights are stored once, K-major
([in, out] in memory); the parameter the model keeps is its transposed view, so checkpoint
names, shapes and every torch form that reads it stay as they were, and the fused decode
blocks read the same memory instead of keeping a transposed copy. F.linear remains the
reference (tests/ops/test_cpu_linear.py), and takes everything this does not: other dtypes
and devices, autograd, and weights stored row-major.

Each output sums its products in K order whatever the rows (row_products.h), so a row's
result does not depend on how many rows share its step. bf16 rows of a bf16 weight (a bf16
model's torch forms) go over as they are: on a CPU with AVX-512 BF16 the tiles then run as dot
products of pairs (csrc/pair_tiles.h), the same sums at 1.4-1.7x the rate."""

from __future__ import annotations

import ctypes
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.ops.cpu_kernels import _I64, _PTR, _c_function

# narrower layers (K3's one-output residual projections) are left to torch
MIN_OUTPUTS = 16


# the weight dtypes with a compiled product; bf16 weights are widened inside it, the
# activations and sums are fp32 (this CPU kind has no bf16 arithmetic: torch's bf16 products
# ran a 128-token prefill of a 0.55B-parameter model in 24 s, llama.cpp in 0.6 s)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def _kernel(dtype: torch.dtype = torch.float32):
    return _c_function("decode_cpu.c", f"linear_rows_{_SUFFIX[dtype]}",
                       [_I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64])


@cache
def _kernel_x16():
    """linear_rows over bf16 rows and bf16 weights (pair tiles where the CPU has AVX-512 BF16):
    returns 0, or -1 when its scratch could not be allocated."""
    fn = _c_function("decode_cpu.c", "linear_rows_x16_bf16",
                     [_I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64])
    if fn is not None:
        fn.restype = ctypes.c_int64
    return fn


def available() -> bool:
    """True when the compiled product is there (a C compiler, kernels not disabled)."""
    return _kernel() is not None


def k_major(w: torch.Tensor) -> bool:
    """True when the [out, in] weight w is an fp32 or bf16 CPU view of K-major memory that
    the compiled product reads in place: its rows of K (w.stride(1) elements apart) hold the
    outputs contiguously, maybe padded (k_major_weight)."""
    return (w.dtype in _SUFFIX and w.device.type == "cpu" and w.dim() == 2
            and w.stride(0) == 1 and w.stride(1) >= w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias); through the compiled product when w is stored K-major. A bf16
    weight gives its input's dtype back, each output rounded once from its fp32 sum."""
    if (bias is not None or x.dtype not in _SUFFIX or x.device.type != "cpu"
            or not k_major(w) or (torch.is_grad_enabled() and (x.requires_grad
                                                                or w.requires_grad))):
        return F.linear(x, w, bias)
    fn = _kernel(w.dtype)
    if fn is None or (w.dtype == torch.float32 and x.dtype != torch.float32):
        return F.linear(x, w, bias)
    N, K = w.shape
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], N, dtype=torch.float32)
    if not rows.shape[0]:
        return out.view(*x.shape[:-1], N).to(x.dtype)
    # bf16 rows of a bf16 weight: the C side widens them (and pairs them for the BF16 dot
    # products, the same sums); else fp32 rows
    x16 = _kernel_x16() if rows.dtype == w.dtype == torch.bfloat16 else None
    if x16 is None or x16(rows.shape[0], N, K, rows.data_ptr(), rows.stride(0), w.data_ptr(),
                          w.stride(1), out.data_ptr(), N, torch.get_num_threads()) != 0:
        if rows.dtype != torch.float32:
            rows = rows.float()
        fn(rows.shape[0], N, K, rows.data_ptr(), rows.stride(0), w.data_ptr(), w.stride(1),
           out.data_ptr(), N, torch.get_num_threads())
    return out.view(*x.shape[:-1], N).to(x.dtype)


class KMajorLinear(nn.Linear):
    """An nn.Linear whose weight is a view of K-major memory (see store_k_major)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def k_major_weight(w: torch.Tensor, pad: bool = False) -> nn.Parameter:
    """w [out, in] re-stored K-major; the parameter is the [out, in] view of that memory.
    pad: fp32 rows of K whose length is a multiple of 4 KiB get one cache line more. Rows that far
    apart put a tile's column of weights (row_products.h) in one set of each cache, which
    then holds 8 of its 256 lines: a [256 x 4096] product at 32 rows took 860 us, against 490
    with the rows 4,112 floats apart (the demo's LM head, AVX2 EPYC)."""
    out, k = w.shape
    ld = out
    # fp32 only: a bf16 head's one-row products take rows_split.h's path, which reads its rows
    # N apart (the fused blocks' head then goes through it unpadded)
    if pad and w.element_size() == 4 and (out * 4) % 4096 == 0:
        ld = out + 16
    store = torch.empty(k, ld, dtype=w.dtype, device=w.device)
    store[:, :out].copy_(w.detach().t())
    if ld > out:
        store[:, out:].zero_()
    return nn.Parameter(store[:, :out].t(), requires_grad=False)


def store_k_major(module: nn.Module, skip: tuple[nn.Module, ...] = (), pad: bool = False
                  ) -> int:
    """Re-stores the fp32 and bf16 CPU nn.Linear layers under `module` (except those in `skip` and
    those with a bias or fewer than MIN_OUTPUTS outputs) K-major and makes them KMajorLinear;
    returns how many. A weight shared with another module (tied embeddings) must be skipped
    by the caller: the other module would read the new layout. pad: see k_major_weight (the
    fused decode blocks take a padded store for the LM head only)."""
    if not available():
        return 0
    done = 0
    for sub in module.modules():
        if (type(sub) is nn.Linear and sub not in skip and sub.bias is None
                and sub.weight.dtype in _SUFFIX and sub.weight.device.type == "cpu"
                and sub.out_features >= MIN_OUTPUTS):
            if not k_major(sub.weight):
                sub.weight = k_major_weight(sub.weight, pad)
            sub.__class__ = KMajorLinear
            done += 1
    return done
