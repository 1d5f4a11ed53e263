"""Compiles a Triton kernel for a CUDA target without a GPU (Triton's own compiler and the
ptxas it ships): a CPU-only session checks that a kernel builds for the H200 (sm_90), not only
that the interpreter runs it. Only where TRITON_INTERPRET is unset (the interpreter replaces
@triton.jit functions with its own), so the kernel tests call it in a subprocess."""

from __future__ import annotations

from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)


def compile_for(kernel, types: dict[str, str], constants: dict[str, Any],
                target: GPUTarget = H200):
    """kernel: a @triton.jit function; types: Triton type strings of its pointer and float
    arguments ("*bf16", "fp32"; the rest are i32); constants: its constexpr arguments.
    Returns the compiled kernel (its cubin in .asm["cubin"])."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    consts = {(names.index(n),): v for n, v in constants.items()}
    return triton.compile(ASTSource(kernel, signature, constexprs=consts), target=target)
