from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """A tiny random transformers KimiLinear saved with save_pretrained: (dir, hf model)."""
    from hf_reference import make_hf_checkpoint

    out = tmp_path_factory.mktemp("hf_tiny")
    model = make_hf_checkpoint(out)
    return out, model
