"""HF `config.json` of `model_type: kimi_k3` <-> ModelConfig.

Kimi K3 wraps a kimi_linear-typed `text_config` that adds the K3 block fields (SiTU,
attention-residuals, latent MoE, gated KDA/MLA), a `vision_config`, the media placeholder id and
the routed experts' quantization; its text weights live under `language_model.`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kdaserve.config import ConfigError
from kdaserve.model.configs import kimi_linear
from kdaserve.model_config import ModelConfig

# compressed-tensors formats of the routed experts that the loader understands
_EXPERT_FORMATS = {"mxfp4-pack-quantized": "mxfp4"}

_K3_TOP_FIELDS = frozenset({
    "architectures", "model_type", "text_config", "vision_config", "media_placeholder_token_id",
    "quantization_config", "auto_map", "dtype", "torch_dtype", "transformers_version",
    "eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings", "use_cache",
    "_name_or_path", "ignore_index", "image_token_index",
})


def parse(raw: dict[str, Any]) -> ModelConfig:
    """The K3 wrapper: text_config (or, as mlx-lm allows, a flat config) plus the top-level
    multimodal and quantization fields."""
    text = dict(raw.get("text_config") or
                {k: v for k, v in raw.items() if k not in _K3_TOP_FIELDS})
    text.pop("model_type", None)
    qc = raw.get("quantization_config") or text.pop("quantization_config", None)
    text.pop("quantization_config", None)
    cfg = kimi_linear.parse(text)
    extra = {k: raw[k] for k in raw if k not in _K3_TOP_FIELDS and "text_config" in raw}
    if extra:
        raise ConfigError(f"config.json: unknown top-level field(s) "
                          f"{', '.join(map(repr, sorted(extra)))} for kimi_k3")
    return replace(
        cfg, architecture="kimi_k3", experts_quantization=_expert_format(qc),
        media_placeholder_token_id=raw.get("media_placeholder_token_id"),
        vision_config=raw.get("vision_config"),
        eos_token_id=cfg.eos_token_id or kimi_linear.eos_token_ids(raw.get("eos_token_id")))


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """mlx-lm's kimi_k3 layout (which llama.cpp's converter also reads)."""
    text = kimi_linear.to_hf(cfg)
    text["architectures"] = ["KimiLinearForCausalLM"]
    lin = text["linear_attn_config"]
    lin["use_full_rank_gate"] = cfg.kda_full_rank_gate
    if cfg.kda_gate_lower_bound is not None:
        lin["gate_lower_bound"] = cfg.kda_gate_lower_bound
    text.update(
        hidden_act=cfg.hidden_act, activation_situ_beta=cfg.activation_situ_beta,
        activation_situ_linear_beta=cfg.activation_situ_linear_beta,
        attn_res_block_size=cfg.attn_res_block_size,
        routed_expert_hidden_size=cfg.routed_expert_hidden_size,
        latent_moe_use_norm=cfg.latent_moe_use_norm,
        mla_use_output_gate=cfg.mla_use_output_gate)
    out: dict[str, Any] = {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "text_config": text, "vision_config": cfg.vision_config,
        "media_placeholder_token_id": cfg.media_placeholder_token_id,
        "eos_token_id": text["eos_token_id"],
    }
    if cfg.experts_quantization == "mxfp4":
        out["quantization_config"] = {"quant_method": "compressed-tensors",
                                      "format": "mxfp4-pack-quantized"}
    return out


def _expert_format(qc: dict[str, Any] | None) -> str | None:
    """compressed-tensors quantization_config -> the routed experts' storage format."""
    if not qc:
        return None
    method = qc.get("quant_method")
    fmts = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()
                                 if isinstance(g, dict)}
    fmts.discard(None)
    if method != "compressed-tensors" or len(fmts) != 1 or next(iter(fmts)) not in _EXPERT_FORMATS:
        raise ConfigError(
            f"config.json: quantization_config {method!r} / format {sorted(fmts)} is not "
            f"supported (supported: compressed-tensors {sorted(_EXPERT_FORMATS)})")
    return _EXPERT_FORMATS[next(iter(fmts))]
