from __future__ import annotations

import sys
from pathlib import Path

# the server tests' harness (a tiny model directory, servers as subprocesses)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from server_harness import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))
