"""Compiles the kernels for an H200 (sm_90) at the model's shapes and prints each variant's
resource usage as JSON: `python tests/ops/gpu/compile_sm90.py`. Needs triton's NVIDIA backend
(ptxas and cuobjdump come with it), not a GPU; run without TRITON_INTERPRET (the interpreter
replaces the language's builtins). test_compile_sm90.py runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kdaserve.ops.gpu import kda_decode, mla_decode

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
H200 = GPUTarget("cuda", 90, 32)


def compile_usage(fn, types: dict[str, str], meta: dict, tmp: Path) -> dict[str, int]:
    """fn compiled for sm_90; its cubin's resource usage (REG, STACK, LOCAL, SHARED, ...)."""
    consts = {k: v for k, v in meta.items() if not k.startswith("num_")}
    opts = {k: v for k, v in meta.items() if k.startswith("num_")}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, consts), target=H200, options=opts)
    cubin = tmp / f"{fn.__name__}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)],
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if "REG:" in x)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


def variants() -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for dt, keep in (("bf16", False), ("bf16", True), ("fp32", True)):
        types = dict(store="*fp32", slots="*i64", q=f"*{dt}", k=f"*{dt}", v=f"*{dt}",
                     g=f"*{dt}", beta=f"*{dt}", o="*fp32", kept="*fp32")
        # Kimi Linear's KDA: head dim 128
        out[f"kda_decode_{dt}_keep{int(keep)}"] = (kda_decode._kda_decode_kernel, types,
                                                   kda_decode.launch_meta(128, 128, keep))
    for dt, exact in (("bf16", False), ("fp32", True)):
        types = dict(q_c=f"*{dt}", q_r=f"*{dt}", pages=f"*{dt}", blocks="*i64",
                     kv_lens="*i64", o_part="*fp32", lse_part="*fp32", scale="fp32")
        # Kimi-Linear-48B's MLA: kv_lora_rank 512, rope dim 64
        out[f"mla_split_{dt}"] = (mla_decode._split_kernel, types,
                                  mla_decode.split_meta(512, 64, exact))
    out["mla_merge"] = (mla_decode._merge_kernel,
                        dict(o_part="*fp32", lse_part="*fp32", kv_lens="*i64", out="*fp32"),
                        mla_decode.merge_meta(512))
    return out


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        usage = {name: compile_usage(*v, Path(tmp)) for name, v in variants().items()}
    json.dump(usage, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
