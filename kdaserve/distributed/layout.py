"""Which layouts a model admits, and what one rank holds of it. Checked in the engine core
before any worker starts, so a bad layout is a clear startup error, never a crash in a rank."""

from __future__ import annotations

import os
from dataclasses import replace

from kdaserve.config import ConfigError, EngineConfig
from kdaserve.model_config import ModelConfig


def _divides(what: str, n: int, size: int, flag: str) -> None:
    if n % size:
        raise ConfigError(f"{flag} {size} does not divide the model's {what} ({n})")


def available_ranks(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.device_count()
    return os.cpu_count() or 1


def check_layout(cfg: ModelConfig, config: EngineConfig) -> None:
    par = config.parallel
    tp, ep = par.tensor_parallel_size, par.expert_parallel_size
    have = available_ranks(config.device)
    # torchrun and Ray place ranks on other machines too: they check their own resources
    if par.executor == "mp" and par.world_size > have:
        where = "GPUs" if config.device.startswith("cuda") else "CPU cores"
        raise ConfigError(f"the layout needs {par.world_size} ranks but this machine has "
                          f"{have} {where}")
    if tp > 1:
        flag = "--tensor-parallel-size"
        if cfg.kda_layers:
            _divides("KDA heads", cfg.kda_num_heads, tp, flag)
        if cfg.mla_layers:
            _divides("MLA heads", cfg.num_attention_heads, tp, flag)
        _divides("vocabulary", cfg.vocab_size, tp, flag)
        if any(not cfg.is_moe(i) for i in range(cfg.num_hidden_layers)):
            _divides("dense MLP width", cfg.intermediate_size, tp, flag)
        if cfg.moe_layers and cfg.num_shared_experts:
            _divides("shared experts' width", cfg.moe_intermediate_size * cfg.num_shared_experts,
                     tp, flag)
        if cfg.moe_layers and ep == 1:
            _divides("expert width", cfg.moe_intermediate_size, tp, flag)
    if ep > 1:
        if not cfg.moe_layers:
            raise ConfigError("--expert-parallel-size needs a model with routed experts")
        _divides("routed experts", cfg.num_experts, ep, "--expert-parallel-size")
    if par.data_parallel_size > 1 and config.cache.offload_tiers:
        raise ConfigError("offload tiers do not combine with --data-parallel-size > 1 yet (each "
                          "rank's cache holds other requests); TP and EP layouts support them")
    pp = par.pipeline_parallel_size
    if pp > 1:
        if pp > cfg.num_hidden_layers:
            raise ConfigError(f"--pipeline-parallel-size {pp} exceeds the model's "
                              f"{cfg.num_hidden_layers} decoder layers (each stage needs one)")
        if config.cache.offload_tiers:
            raise ConfigError("offload tiers do not combine with --pipeline-parallel-size > 1 "
                              "yet (each stage would store its own layers' share); TP and EP "
                              "layouts support them")
        spec = config.speculative
        if spec is not None and spec.method == "dspark":
            raise ConfigError("--pipeline-parallel-size > 1 serves n-gram speculation only "
                              "(--speculative-method ngram); the DSpark draft reads hidden "
                              "states of several stages and is not wired for pipeline ranks")
    backend = par.moe_backend
    if backend == "ep_all2all" and ep == 1:
        raise ConfigError("--moe-backend ep_all2all needs --expert-parallel-size > 1")
    if backend in ("reference", "grouped") and (ep > 1 or tp > 1) and cfg.moe_layers:
        raise ConfigError(f"--moe-backend {backend} runs every expert on one rank; with "
                          "several ranks use tp_sharded, ep_all2all or auto")
    if backend == "tp_sharded" and ep > 1:
        raise ConfigError("--moe-backend tp_sharded shards every expert; it does not combine "
                          "with --expert-parallel-size")


def rank_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank's caches hold: its share of the KDA and MLA heads (MLA latents are
    per token, not per head: replicated)."""
    if tp == 1:
        return cfg
    return replace(cfg, kda_num_heads=cfg.kda_num_heads // tp,
                   num_attention_heads=cfg.num_attention_heads // tp)


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The decoder layers of pipeline stage `stage`: contiguous, as even as they divide (the
    first num_layers % pp stages hold one more)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_model_config(cfg: ModelConfig, layers: range) -> ModelConfig:
    """The layers of one stage as a model of their own (indices from 0): the shapes and
    counts of the caches that stage holds."""
    def local(which: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i - layers.start for i in which if i in layers)

    return replace(cfg, num_hidden_layers=len(layers), kda_layers=local(cfg.kda_layers),
                   mla_layers=local(cfg.mla_layers), moe_layers=local(cfg.moe_layers))


def cache_model_config(cfg: ModelConfig, tp: int = 1, pp: int = 1) -> ModelConfig:
    """What the memory planner sizes: one rank's caches. Under pipeline parallelism every
    stage allocates the same number of blocks and slots (the scheduler sees one logical
    cache), so the plan is made for the most KDA and the most MLA layers any stage holds."""
    cfg = rank_model_config(cfg, tp)
    if pp == 1:
        return cfg
    stages = [stage_model_config(cfg, stage_layers(cfg.num_hidden_layers, pp, s))
              for s in range(pp)]
    kda = max(len(c.kda_layers) for c in stages)
    mla = max(len(c.mla_layers) for c in stages)
    return replace(cfg, num_hidden_layers=kda + mla, kda_layers=tuple(range(kda)),
                   mla_layers=tuple(range(kda, kda + mla)), moe_layers=())
