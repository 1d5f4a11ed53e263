from __future__ import annotations

import pytest
from server_harness import MAIN_SERVER_ARGS, build_tiny_model, start_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """The server most tests share: no API key, default limits but a small body limit."""
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = start_server(tiny_model_dir, log, *MAIN_SERVER_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """The bundled demo model with K3's tool-call and reasoning parsers (structured outputs and
    tool tests)."""
    from kdaserve.assets import KIMI_LINEAR_DEMO_DIR

    log = tmp_path_factory.mktemp("logs") / "demo.log"
    srv = start_server(KIMI_LINEAR_DEMO_DIR, log, *MAIN_SERVER_ARGS, "--torch-threads", "1",
                       "--served-model-name", "kdaserve-demo",
                       "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3")
    yield srv
    srv.stop()
