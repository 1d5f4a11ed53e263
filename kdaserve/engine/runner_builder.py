"""The one place a model runner is made, for the engine core's own process and for each
worker rank alike: the model loaded (or taken) and prepared for inference with its MoE
backend, the proposer, the grammar masks and the offload stores wired to a `ModelRunner`."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from kdaserve.cache.planner import CachePlan
from kdaserve.config import EngineConfig
from kdaserve.engine.runner import ModelRunner
from kdaserve.engine.spec.proposer import NgramDrafts, Proposer
from kdaserve.engine.tier_transfer import Store
from kdaserve.model.base import HybridForCausalLM
from kdaserve.model.loader import load_model

logger = logging.getLogger("kdaserve")


def default_chunk_size(device: torch.device) -> int:
    """64 suits the GPU kernels; the torch form is several times faster with small chunks on CPU."""
    return 64 if device.type == "cuda" else 16


def engine_chunk_size(config: EngineConfig) -> int:
    chunk = config.kda_chunk_size or default_chunk_size(torch.device(config.device))
    # Snapshots sit on block boundaries, which must be KDA chunk boundaries (powers of 2).
    return min(chunk, config.cache.block_size)


def has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tiktoken.model").is_file()


def prepare_model(config: EngineConfig, device: torch.device,
                  model: HybridForCausalLM | None = None, parallel=None,
                  progress: bool = False) -> HybridForCausalLM:
    """The model ready for inference: loaded from `config.model` unless given (with
    `parallel`, a kdaserve.distributed ParallelContext: this rank's share), its KDA chunk size
    set, fused for inference, its MoE backend chosen."""
    chunk = engine_chunk_size(config)
    backend = config.parallel.moe_backend
    quant = None
    if config.quantization is not None:
        from kdaserve.quant_config import from_scheme

        quant = from_scheme(config.quantization, config.quantization_group_size)
    if model is None:
        # a rank's experts are sharded by its backend while loading (shapes depend on it)
        model = load_model(config.model, dtype=config.dtype, device=str(device),
                           chunk_size=chunk, progress=progress, parallel=parallel,
                           moe_backend=backend, quantization=quant)
    else:
        model.set_chunk_size(chunk)
        if quant is not None and model.config.weight_quant is None:
            from kdaserve.model.quantize import quantize_model

            quantize_model(model, quant)      # a model handed in: quantized in place
    model = model.fuse_for_inference()
    if parallel is None and backend != "auto":    # one process holds every expert
        from kdaserve.model.moe_backends import set_moe_backend

        set_moe_backend(model, backend)
    return model


def build_proposer(config: EngineConfig, model: HybridForCausalLM,
                   device: torch.device, plan: CachePlan) -> Proposer | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramDrafts(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
    from kdaserve.engine.spec.dspark import DSparkProposer

    return DSparkProposer.from_config(spec, config, model, device, plan.num_blocks,
                                      plan.block_size)


def build_runner(config: EngineConfig, plan: CachePlan, model: HybridForCausalLM,
                 device: torch.device, tokenizer=None,
                 stores: Mapping[str, Store] | None = None) -> ModelRunner:
    """A runner over a prepared model (`prepare_model`) and a cache sized by `plan`."""
    from kdaserve.engine.decode_graphs import decode_graphs_log
    from kdaserve.structured.manager import StructuredOutputs

    graphs = graph_backend(config, device)
    runner = ModelRunner(model, plan, device, seed=config.seed,
                         proposer=build_proposer(config, model, device, plan), stores=stores,
                         structured=StructuredOutputs(tokenizer, model.config.vocab_size),
                         graphs=graphs)
    spec = config.speculative
    runner.sampler.block_verification = (spec is not None
                                         and spec.rejection_sample_method == "block")
    if graphs is not None:
        max_len = min(config.scheduler.max_model_len, model.config.max_position_embeddings)
        decode_graphs_log(runner.capture_graphs(config.scheduler.max_num_seqs, max_len))
    return runner


def graph_backend(config: EngineConfig, device: torch.device) -> str | None:
    """Captured decode graphs: on CUDA unless --enforce-eager. KDASERVE_DECODE_GRAPHS=replay
    runs the same mechanism on CPU by calling the recorded step again (the tests); =0 off."""
    env = os.environ.get("KDASERVE_DECODE_GRAPHS", "")
    if env == "0" or config.enforce_eager:
        return None
    if env == "replay":
        return "replay"
    return "cuda" if device.type == "cuda" else None
