"""An instance's disaggregation settings from its flags: `--role`, `--kv-transfer-*`,
`--kv-connector`, and vLLM's JSON form `--kv-transfer-config` whose keys go over the flags
(as `--speculative-config` does for speculation), e.g.

    --role prefill --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                           "kv_ip": "10.0.0.2", "kv_port": 9200}'

vLLM's `kv_both` (an instance that may do either) means here: the role `--role` gives. The
NIXL connector is checked here, before any weights load, so a missing `nixl` is a clear error
at start.
"""

from __future__ import annotations

from typing import Any

from kdaserve.config import ConfigError, KVTransferConfig, json_flag

CONNECTOR_NAMES = {"NixlConnector": "nixl", "nixl": "nixl", "ZmqConnector": "zmq", "zmq": "zmq"}
KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": None}
JSON_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port")


def from_json(text: str) -> dict[str, Any]:
    """--kv-transfer-config's JSON as settings: connector, role, host, port (those given)."""
    raw = json_flag(text, "--kv-transfer-config", JSON_KEYS)
    out: dict[str, Any] = {}
    if "kv_connector" in raw:
        if raw["kv_connector"] not in CONNECTOR_NAMES:
            raise ConfigError(f"--kv-transfer-config: kv_connector must be one of "
                              f"{sorted(CONNECTOR_NAMES)}, got {raw['kv_connector']!r}")
        out["connector"] = CONNECTOR_NAMES[raw["kv_connector"]]
    if "kv_role" in raw:
        if raw["kv_role"] not in KV_ROLES:
            raise ConfigError(f"--kv-transfer-config: kv_role must be one of "
                              f"{sorted(KV_ROLES)}, got {raw['kv_role']!r}")
        if KV_ROLES[raw["kv_role"]] is not None:
            out["role"] = KV_ROLES[raw["kv_role"]]
    if "kv_ip" in raw:
        if not isinstance(raw["kv_ip"], str) or not raw["kv_ip"]:
            raise ConfigError("--kv-transfer-config: kv_ip must be an address")
        out["host"] = raw["kv_ip"]
    if "kv_port" in raw:
        port = raw["kv_port"]
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise ConfigError("--kv-transfer-config: kv_port must be a port number")
        out["port"] = port
    return out


def kv_transfer_config(role: str | None, port: int | None, host: str, timeout_s: float,
                       ttl_s: float, connector: str = "zmq", json_text: str | None = None
                       ) -> KVTransferConfig | None:
    """The instance's KVTransferConfig (None: colocated), the JSON's keys over the flags."""
    settings: dict[str, Any] = {"role": role, "port": port, "host": host,
                                "connector": connector}
    if json_text:
        settings.update(from_json(json_text))
        if settings["role"] is None:
            raise ConfigError("--kv-transfer-config needs a role: kv_role kv_producer or "
                              "kv_consumer, or --role prefill|decode")
    if settings["role"] is None:
        if connector != "zmq":
            raise ConfigError("--kv-connector needs --role prefill|decode")
        return None
    config = KVTransferConfig(settings["role"], settings["port"], settings["host"], timeout_s,
                              ttl_s, settings["connector"])
    if config.connector == "nixl":
        from kdaserve.disagg.nixl_connector import require_nixl

        require_nixl()
    return config
