"""Kernel tests that run on CUDA, or on CPU under Triton's interpreter (TRITON_INTERPRET=1).

The main test environment keeps triton absent (transformers' kimi_linear would switch to fla's
Triton kernels, which fail on CPU), so this directory is not collected there;
tests/ops/test_triton_interpret.py runs it in a subprocess that puts a side install of triton on
the path and sets TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if torch.cuda.is_available():
    DEVICE: torch.device | None = torch.device("cuda")
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
else:
    DEVICE = None

if DEVICE is None or importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def device() -> torch.device:
    assert DEVICE is not None
    return DEVICE
