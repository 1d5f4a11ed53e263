"""What an engine core is built from, before its scheduler and executor: the model (loaded here,
or only its config when worker ranks load it), the cache plan that sizes both, and the startup
report of the weights as loaded."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kdaserve.cache.planner import CachePlan, plan_cache
from kdaserve.cache.spec import specs_for
from kdaserve.config import EngineConfig, SchedulerConfig
from kdaserve.engine.device_memory import cache_budget
from kdaserve.engine.runner_builder import prepare_model
from kdaserve.model.base import HybridForCausalLM
from kdaserve.model.loader import checkpoint_has_vision
from kdaserve.model.packed_args import has_packed, packed_footprint
from kdaserve.model.registry import load_config
from kdaserve.model.vision.tower import vision_config_of
from kdaserve.ops import stream_tune

logger = logging.getLogger("kdaserve")


@dataclass
class EngineModel:
    model: HybridForCausalLM | None      # None: the worker ranks hold it
    config: Any                          # the whole model's ModelConfig
    rank_config: Any                     # one rank's share (TP heads, a PP stage's layers)
    vision: Any                          # the vision tower's config, or None


def load_engine_model(config: EngineConfig, device: torch.device,
                      model: HybridForCausalLM | None, progress: bool) -> EngineModel:
    par = config.parallel
    if par.executor != "uni":
        if model is not None:
            raise ValueError("a multi-process layout loads the model in each worker from "
                             "config.model; pass no model object")
        from kdaserve.distributed.layout import cache_model_config, check_layout

        cfg = load_config(config.model)
        check_layout(cfg, config)                 # refused here, before any process starts
        # the ranks load the model; the engine checks images against the config alone
        vision = vision_config_of(cfg) if checkpoint_has_vision(config.model) else None
        return EngineModel(None, cfg, cache_model_config(cfg, par.tensor_parallel_size,
                                                         par.pipeline_parallel_size), vision)
    model = prepare_model(config, device, model, progress=progress)
    tower = getattr(model, "vision_tower", None)
    log_weights(model, config)
    if device.type == "cpu" and has_packed(model):
        # measured now, not in the first request's first decode step (fused_decode asks too)
        stream_tune.tune(*packed_footprint(model))
    return EngineModel(model, model.config, model.config,
                       tower.cfg if tower is not None else None)


def engine_cache_plan(config: EngineConfig, em: EngineModel,
                      device: torch.device) -> tuple[CachePlan, SchedulerConfig]:
    """The cache plan (sized per rank: a tensor-parallel rank holds its heads' KDA states, a
    pipeline stage its layers' caches) and the scheduler config, its max_model_len capped by
    the model's positions."""
    cc, sched = config.cache, config.scheduler
    latent, state = specs_for(em.rank_config, cc.block_size, config.dtype, cc.kv_cache_dtype)
    max_len = min(sched.max_model_len, em.config.max_position_embeddings)
    if max_len != sched.max_model_len:
        sched = SchedulerConfig(**{**sched.__dict__, "max_model_len": max_len})
    memory = cache_budget(cc, device)
    snapshot_bytes = 0
    if cc.enable_prefix_caching:
        snapshot_bytes = cc.state_snapshot_budget_bytes
        if snapshot_bytes is None:
            snapshot_bytes = memory // 4
    plan = plan_cache(latent, state, memory, sched.max_num_seqs, num_blocks=cc.num_blocks,
                      num_state_slots=cc.num_state_slots, snapshot_bytes=snapshot_bytes,
                      max_model_len=max_len)
    return plan, sched


def log_weights(model: HybridForCausalLM, config: EngineConfig) -> None:
    rep = model.weight_report()
    wq = model.config.weight_quant
    logger.info("kdaserve weights: %.1f MiB as loaded (%s)%s", rep["bytes"] / 2**20,
                model.config.architecture,
                f"; routed experts {rep['expert_bytes'] / 2**20:.1f} MiB, "
                f"{rep['expert_bytes_per_weight']:.4g} bytes per weight"
                f" ({model.config.experts_quantization or (wq and wq.scheme) or config.dtype})"
                if rep["expert_weights"] else "")
    from kdaserve.model.inspect import measure_model

    per = measure_model(model, model.config).bytes_per_weight()
    logger.info("kdaserve bytes per weight as loaded: %s", ", ".join(
        f"{part} {b:.3g}" for part, b in sorted(per.items(), key=lambda kv: kv[0])))
