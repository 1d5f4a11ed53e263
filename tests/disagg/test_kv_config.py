"""An instance's disaggregation settings from `kdaserve serve` flags: the plain flags, vLLM's
`--kv-transfer-config` JSON over them, and the errors a bad one gets (a missing `nixl`
included, before any weights load)."""

from __future__ import annotations

import argparse
import sys

import pytest

from kdaserve.config import ConfigError, KVTransferConfig
from kdaserve.engine.args import EngineArgs
from kdaserve.server.cli import add_serve_arguments


def _kv(argv: list[str]) -> KVTransferConfig | None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return EngineArgs.from_cli(parser.parse_args(argv)).to_engine_config().kv_transfer


def test_flags_and_the_vllm_json_form():
    pytest.importorskip("nixl", reason="nixl is not installed (pip install 'kdaserve[disagg]')")
    assert _kv([]) is None
    assert _kv(["--role", "prefill"]) == KVTransferConfig("prefill")
    assert _kv(["--role", "decode", "--kv-transfer-port", "9200", "--kv-connector", "nixl"]
               ) == KVTransferConfig("decode", 9200, connector="nixl")
    assert _kv(["--role", "prefill", "--kv-transfer-config",
                '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}']
               ) == KVTransferConfig("prefill", connector="nixl")
    assert _kv(["--kv-transfer-port", "1", "--kv-transfer-config",
                ('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", '
                 '"kv_ip": "10.0.0.2", "kv_port": 9201}')]
               ) == KVTransferConfig("decode", 9201, "10.0.0.2", connector="nixl")


@pytest.mark.parametrize("argv, message", [
    (["--kv-transfer-config", "{"], "is not JSON"),
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'],
     "needs a role"),
    (["--role", "prefill", "--kv-transfer-config", '{"kv_buffer_size": 1}'],
     r"unknown keys \['kv_buffer_size'\]"),
    (["--role", "prefill", "--kv-transfer-config", '{"kv_connector": "LMCacheConnector"}'],
     "kv_connector must be one of"),
    (["--kv-connector", "nixl"], "needs --role"),
])
def test_bad_settings_are_clear_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        _kv(argv)


def test_a_missing_nixl_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)      # what an absent package imports as
    with pytest.raises(ConfigError, match=r"needs the `nixl` package \(pip install "
                                          r"'kdaserve\[disagg\]'"):
        _kv(["--role", "prefill", "--kv-transfer-config", '{"kv_connector": "NixlConnector"}'])
