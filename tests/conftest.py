from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, torch.get_num_threads()))
# The engine's start-up freeze (kdaserve/ops/host_memory.py) thaws and fully collects the heap
# first: ~0.25 s of CPU at each of the hundreds of engine starts in this process, a fifth of
# an engine test's time. Tested on its own in tests/ops/test_host_memory.py; the servers the
# tests start freeze as in production (server_harness.start_server).
os.environ.setdefault("KDASERVE_GC_FREEZE", "0")


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """A tiny random transformers KimiLinear saved with save_pretrained: (dir, hf model)."""
    from hf_reference import make_hf_checkpoint

    out = tmp_path_factory.mktemp("hf_tiny")
    model = make_hf_checkpoint(out)
    return out, model
