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
