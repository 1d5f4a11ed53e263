"""Gives an engine its kv-transfer connector (serve --role prefill|decode): the model
identity and cache layout a transfer must match, its connector (ZeroMQ, or NIXL with
--kv-connector nixl), and the torch side that the runner's executor of cache operations
calls: on the engine's own runner, or on every rank of a tensor-parallel instance
(kdaserve/engine/executor/worker.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import xxhash

from kdaserve.config import ConfigError, EngineConfig
from kdaserve.disagg.transfer import CacheTransfer
from kdaserve.disagg.wire import CacheLayout
from kdaserve.disagg.zmq_connector import ZmqConnector


def transfer_layout(cfg: Any, dtype: str, tp_size: int = 1, tp_rank: int = 0,
                    draft: Any = None) -> CacheLayout:
    """`draft`: the DSpark proposer, whose pages travel too (None: no draft)."""
    pages = draft.pages if draft is not None else []
    return CacheLayout(dtype, list(cfg.mla_layers), cfg.mla_latent_dim, list(cfg.kda_layers),
                       cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size,
                       cfg.kda_conv_dim, tp_size, tp_rank, len(pages),
                       pages[0].shape[-1] if pages else 0)


def draft_identity(config: EngineConfig) -> str:
    """The DSpark draft's weights (config + file fingerprints, as the offload tiers key a
    model): two instances exchange draft pages only when theirs are the same."""
    from kdaserve.cache.identity import offload_identity

    spec = config.speculative
    path = Path(spec.draft_model) if spec.draft_model else Path(config.model) / "draft"
    return offload_identity(path, {"draft": True})[0].hex()


def model_identity(model_dir: str | None, layout: CacheLayout) -> str:
    """The offload tiers' identity (config + weight fingerprints + the whole model's layout,
    the same on every rank and for any TP size); without a model directory (a model built
    in-process) the layout alone."""
    from kdaserve.cache.identity import offload_identity

    # the draft is optional on either side (its pages are matched by draft_identity)
    whole = msgspec.structs.replace(layout.whole(), draft_layers=0, draft_latent_dim=0)
    described = {f: getattr(whole, f) for f in whole.__struct_fields__}
    if model_dir and (Path(model_dir) / "config.json").is_file():
        return offload_identity(model_dir, described)[0].hex()
    return xxhash.xxh3_128_hexdigest(repr(sorted(described.items())).encode())


def check_role_layout(config: EngineConfig) -> None:
    """Before any rank starts: either role may run tensor parallel (a prefill rank sends its
    heads' states, the decode side joins them; a decode instance's rank 0 receives and hands
    each rank its heads), not data or pipeline parallel (a rank would hold another request's
    cache, or another layer's)."""
    kt, par = config.kv_transfer, config.parallel
    if kt is None or par.world_size == 1:
        return
    if par.world_size != par.tensor_parallel_size:
        raise ConfigError(f"--role {kt.role} runs tensor parallel only: expert, data and "
                          "pipeline parallel size must be 1 (or expert parallel equal to "
                          "tensor parallel)")


def attach_transfer(config: EngineConfig, cfg: Any, runner: Any, tp_size: int = 1,
                    tp_rank: int = 0, group: Any = None) -> CacheTransfer:
    """`cfg`: this rank's share of the model (its KDA heads); `group`: the ranks' control
    group (a tensor-parallel decode instance's rank 0 hands the others their share on it)."""
    kt = config.kv_transfer
    assert kt is not None
    check_role_layout(config)
    draft = runner.proposer if hasattr(runner.proposer, "export_context") else None
    layout = transfer_layout(cfg, config.dtype, tp_size, tp_rank, draft)
    identity = model_identity(config.model, layout)
    kind = ZmqConnector
    if kt.connector == "nixl":
        from kdaserve.disagg.nixl_connector import NixlConnector as kind
    decode = kt.role == "decode"
    # a decode instance receives on rank 0 alone, checking and joining as the whole model
    connector = kind(identity, layout.whole() if decode else layout,
                     port=kt.port if decode and tp_rank == 0 else None,
                     host=kt.host, send_timeout_s=kt.timeout_s, ttl_s=kt.ttl_s)
    take = None
    if decode and tp_size > 1:
        from kdaserve.disagg.rank_receive import RankReceiver

        take = RankReceiver(connector, tp_size, tp_rank, group).take
    transfer = CacheTransfer(runner.cache, connector, identity, layout, kt.timeout_s, draft,
                             draft_identity(config) if draft is not None else "", take)
    runner.cache_ops.transfer = transfer
    return transfer


# counters that add up over the ranks (each sends its share); the others are rank 0's (every
# rank sends once per request)
_SUMMED = ("sent_mla_bytes", "sent_kda_bytes", "sent_draft_bytes")


def rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The /metrics counters of a tensor-parallel prefill instance, from every rank's."""
    out = dict(per_rank[0])
    for k in _SUMMED:
        out[k] = sum(m.get(k, 0.0) for m in per_rank)
    return out


class RankTransfers:
    """The engine core's handle on its ranks' transfers (they live in the worker processes):
    their counters, for /metrics; where a decode instance's rank 0 receives; the drafts that
    came with a transfer."""

    def __init__(self, executor: Any, speculates: bool = False) -> None:
        self.executor = executor
        self.speculates = speculates

    def metrics(self) -> dict[str, float]:
        return self.executor._call(("kv_transfer_stats",), "reporting")

    @property
    def address(self) -> str | None:
        return self.executor._call(("kv_transfer_address",), "reporting")

    def arrived_drafts(self, transfer_id: str) -> list[int]:
        if not self.speculates:    # no drafter here: spare every import a trip to rank 0
            return []
        return self.executor._call(("kv_transfer_drafts", transfer_id), "reporting")
