"""GPU kernels (Triton), each the fast form of a torch reference in `kdaserve.ops`.

Every kernel here has the same contract as the reference it replaces; the ops registry picks it
on CUDA when triton imports, and the reference stays as the oracle the tests compare against.
The kernels also run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`), which is
how CPU-only CI checks them (tests/ops/test_triton_interpret.py).
"""

from __future__ import annotations

import os
from functools import cache


@cache
def triton_available() -> bool:
    """True where triton imports (a CUDA machine, or the interpreter's side install in tests).
    KDASERVE_TRITON=0 keeps every op on its torch reference."""
    if os.environ.get("KDASERVE_TRITON", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """Triton runs its kernels in the interpreter (on CPU tensors): launch grids stay small."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_for(device_type: str) -> bool:
    """Whether ops on tensors of this device type take the Triton kernels: on CUDA when triton
    imports, and on CPU only under the interpreter (how CPU CI drives the CUDA dispatch through
    a whole model: tests/ops/gpu). Callers look it up as `gpu.kernels_for` at call time."""
    if not triton_available():
        return False
    return device_type == "cuda" or (device_type == "cpu" and interpreting())
