"""Gives an engine its kv-transfer connector (serve --role prefill|decode): the model
identity and cache layout a transfer must match, its connector (ZeroMQ, or NIXL with
--kv-connector nixl), and the torch side that the runner's executor of cache operations
calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xxhash

from kdaserve.config import EngineConfig
from kdaserve.disagg.transfer import CacheTransfer
from kdaserve.disagg.wire import CacheLayout
from kdaserve.disagg.zmq_connector import ZmqConnector


def transfer_layout(cfg: Any, dtype: str, tp_size: int = 1, tp_rank: int = 0) -> CacheLayout:
    return CacheLayout(dtype, list(cfg.mla_layers), cfg.mla_latent_dim, list(cfg.kda_layers),
                       cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size,
                       cfg.kda_conv_dim, tp_size, tp_rank)


def model_identity(model_dir: str | None, layout: CacheLayout) -> str:
    """The offload tiers' identity (config + weight fingerprints + layout); without a model
    directory (a model built in-process) the layout alone."""
    from kdaserve.cache.identity import offload_identity

    described = {f: getattr(layout, f) for f in layout.__struct_fields__}
    if model_dir and (Path(model_dir) / "config.json").is_file():
        return offload_identity(model_dir, described)[0].hex()
    return xxhash.xxh3_128_hexdigest(repr(sorted(described.items())).encode())


def attach_transfer(config: EngineConfig, cfg: Any, runner: Any) -> CacheTransfer:
    kt = config.kv_transfer
    assert kt is not None
    if config.parallel.executor != "uni":
        raise ValueError("--role prefill|decode runs one rank per instance for now (the "
                         "TP layout conversion is not built): use tensor/pipeline/data "
                         "parallel size 1")
    layout = transfer_layout(cfg, config.dtype)
    identity = model_identity(config.model, layout)
    kind = ZmqConnector
    if kt.connector == "nixl":
        from kdaserve.disagg.nixl_connector import NixlConnector as kind
    connector = kind(identity, layout, port=kt.port if kt.role == "decode" else None,
                     host=kt.host, send_timeout_s=kt.timeout_s, ttl_s=kt.ttl_s)
    transfer = CacheTransfer(runner.cache, connector, identity, layout, kt.timeout_s)
    runner.cache_ops.transfer = transfer
    return transfer
