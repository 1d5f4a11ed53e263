"""HF `config.json` of `model_type: kimi_k25` <-> ModelConfig."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kdaserve.config import ConfigError
from kdaserve.model.configs import kimi_linear
from kdaserve.model_config import ModelConfig


def parse(raw: dict[str, Any]) -> ModelConfig:
    """transformers' kimi_k25 (Kimi_K25ForConditionalGeneration) with a kimi_linear
    text_config; the projector's width and eps sit at the top level and are kept with the
    vision_config here. Its ties default to on, as in transformers."""
    text = dict(raw.get("text_config") or {})
    if text.get("model_type", "kimi_linear") != "kimi_linear":
        raise ConfigError(f"config.json: kimi_k25 with a {text.get('model_type')!r} "
                          "text_config is not supported; the text model must be kimi_linear")
    text.pop("model_type", None)
    text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True))
    cfg = kimi_linear.parse(text)
    vc = dict(raw.get("vision_config") or {})
    for src, dst in (("projection_hidden_size", "mm_hidden_size"),
                     ("projection_layer_norm_eps", "projector_ln_eps")):
        if raw.get(src) is not None:
            vc.setdefault(dst, raw[src])
    eos = cfg.eos_token_id or kimi_linear.eos_token_ids(raw.get("eos_token_id"))
    return replace(cfg, architecture="kimi_k25", vision_config=vc,
                   media_placeholder_token_id=raw.get("image_token_id", 163605), eos_token_id=eos)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {"architectures": ["Kimi_K25ForConditionalGeneration"],
            "model_type": "kimi_k25", "text_config": kimi_linear.to_hf(cfg),
            "vision_config": cfg.vision_config,
            "image_token_id": cfg.media_placeholder_token_id,
            "tie_word_embeddings": cfg.tie_word_embeddings}
