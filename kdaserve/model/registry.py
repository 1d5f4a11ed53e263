"""config.json -> model class and config parser. The one place that names concrete model
classes: the engine, loader, CLI, trainers and benches ask here (by `model_type`, or by
`architectures` when a config lacks it), and an unsupported type is an error that lists the
supported ones. The classes are imported on first use, so reading a config needs no torch."""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kdaserve.config import ConfigError
from kdaserve.model.configs import kimi_k3, kimi_k25, kimi_linear
from kdaserve.model_config import ModelConfig
from kdaserve.quant_config import is_pack_quantized, parse_compressed_tensors

if TYPE_CHECKING:
    from kdaserve.model.base import HybridForCausalLM


@dataclass(frozen=True)
class ModelEntry:
    model_type: str
    architectures: tuple[str, ...]
    class_path: str                            # "module:Class"
    kind: str                                  # "target" | "draft"
    # a target family's config.json <-> ModelConfig (parse, to_hf); drafts read their own
    config: ModuleType | None = None

    @property
    def cls(self) -> type:
        module, name = self.class_path.split(":")
        return getattr(importlib.import_module(module), name)


_K3 = "kdaserve.model.kimi_k3:KimiK3ForConditionalGeneration"
_DSPARK = "kdaserve.model.dspark:DSparkDraft"
_ENTRIES = (
    ModelEntry("kimi_linear", ("KimiLinearForCausalLM",),
               "kdaserve.model.kimi_linear:KimiLinearForCausalLM", "target", kimi_linear),
    ModelEntry("kimi_k3", ("KimiK3ForConditionalGeneration", "KimiK3ForCausalLM"), _K3,
               "target", kimi_k3),
    # transformers' Kimi K2.5 layout with a kimi_linear text model: same wrapper, same vision
    ModelEntry("kimi_k25", ("Kimi_K25ForConditionalGeneration",), _K3, "target", kimi_k25),
    ModelEntry("dspark_draft", ("DSparkDraft",), _DSPARK, "draft"),
    ModelEntry("k3_dspark", ("K3DSparkModel", "KimiK3DSparkForCausalLM"), _DSPARK, "draft"),
)


def supported(kind: str | None = None) -> list[str]:
    return [e.model_type for e in _ENTRIES if kind is None or e.kind == kind]


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The raw config.json of a checkpoint directory (or the file itself)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"no config.json at {file}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: a config must be a JSON object")
    return raw


def entry_for(raw: dict[str, Any], kind: str | None = None) -> ModelEntry:
    mt = raw.get("model_type")
    archs = raw.get("architectures") or []
    for e in _ENTRIES:
        if (mt == e.model_type or (mt is None and set(archs) & set(e.architectures))) and (
                kind is None or e.kind == kind):
            return e
    what = f"model_type {mt!r}" if mt is not None else f"architectures {archs!r}"
    raise ConfigError(f"config.json: {what} is not supported; supported "
                      f"{'model types' if kind is None else kind + ' types'}: "
                      f"{', '.join(supported(kind))}")


def load_config(source: str | os.PathLike | dict[str, Any]) -> ModelConfig:
    """The target model's ModelConfig from a directory, a config.json path or a parsed dict.
    A compressed-tensors pack-quantized (INT8/INT4) quantization_config applies to any
    family (block-scaled fp8 too: the loader dequantizes it); the family's parser reads the
    rest."""
    raw = source if isinstance(source, dict) else read_config_json(source)
    qc = raw.get("quantization_config")
    if qc and qc.get("quant_method") == "fp8":     # the loader dequantizes fp8 blocks
        raw = {k: v for k, v in raw.items() if k != "quantization_config"}
        return entry_for(raw, "target").config.parse(raw)
    if is_pack_quantized(qc):
        raw = {k: v for k, v in raw.items() if k != "quantization_config"}
        cfg = entry_for(raw, "target").config.parse(raw)
        return replace(cfg, weight_quant=parse_compressed_tensors(qc))
    return entry_for(raw, "target").config.parse(raw)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """cfg as the config.json of its family (what `load_config` reads back to an equal cfg)."""
    hf = entry_for({"model_type": cfg.architecture}, "target").config.to_hf(cfg)
    if cfg.weight_quant is not None:
        if cfg.experts_quantization is not None:
            raise ConfigError("a checkpoint with MXFP4 experts and INT8/INT4 layers cannot be "
                              "written (one quantization_config)")
        hf["quantization_config"] = cfg.weight_quant.to_compressed_tensors()
    return hf


def build_model(cfg: ModelConfig, chunk_size: int = 16) -> HybridForCausalLM:
    """An (uninitialised) model of cfg's family; build under `torch.device("meta")` to get
    shapes without memory."""
    return entry_for({"model_type": cfg.architecture}, "target").cls(cfg, chunk_size=chunk_size)


def is_draft_config(raw: dict[str, Any]) -> bool:
    try:
        return entry_for(raw).kind == "draft"
    except ConfigError:
        return False


def build_draft(cfg):
    """A new (untrained) draft model of a DraftConfig's layout."""
    return entry_for({"model_type": cfg.layout}, "draft").cls(cfg)


def load_draft(path: str | os.PathLike, dtype=None, device="cpu"):
    """A speculative draft model (any registered draft type) from its directory."""
    import torch

    entry = entry_for(read_config_json(path), "draft")
    return entry.cls.from_pretrained(path, dtype=dtype or torch.float32, device=device)
