"""Frozen, validated configuration records.

`ModelConfig` reads an HF `config.json` of `model_type: kimi_linear` in either of the two shapes
found in the wild: the released checkpoints' (`linear_attn_config`, `first_k_dense_replace`, ...)
and what transformers 5.x `save_pretrained` writes (adds `layer_types`, `mlp_layer_types`,
`linear_num_heads`, ...). Both are checked against each other when both are present.

Kimi K3 (`model_type: kimi_k3`) wraps a kimi_linear-typed `text_config` that adds the K3 block
fields (SiTU, attention-residuals, latent MoE, gated KDA/MLA), a `vision_config`, the media
placeholder id and the routed experts' quantization; its text weights live under
`language_model.`. Which model class serves which config is `kdaserve.model.registry`'s call.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the bookkeeping imports this module and stays free of torch
    from kdaserve.ops.activation import GLUActivation


class ConfigError(ValueError):
    """A config field is unknown, missing, or inconsistent; the message names the field."""


# Fields HF configs carry that do not change the model's math here.
_IGNORED_FIELDS = frozenset(
    {
        "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "use_cache",
        "initializer_range", "output_router_logits", "attention_dropout", "pretraining_tp",
        "num_nextn_predict_layers", "head_dim", "qk_head_dim", "router_aux_loss_coef",
        "_name_or_path", "model_type", "name_or_path", "return_dict", "output_hidden_states",
        "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
        "label2id", "problem_type", "tokenizer_class", "task_specific_params", "pruned_heads",
        "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
        "decoder_start_token_id", "sep_token_id", "finetuning_task", "prefix",
        "linear_conv_kernel_dim", "linear_head_dim", "linear_num_heads",
        "layer_types", "mlp_layer_types", "linear_attn_config", "max_position_embeddings",
        "model_max_length", "n_group", "n_shared_experts", "num_local_experts",
        "num_experts_per_tok", "norm_topk_prob", "kda_gate_lower_bound", "gate_lower_bound",
        "topk_method", "quantization_config",
    }
)

_MODEL_FIELDS = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "kv_lora_rank",
        "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope",
        "rope_theta", "rope_scaling", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
        "attention_bias", "num_experts", "num_experts_per_token", "num_shared_experts",
        "first_k_dense_replace", "moe_layer_freq", "moe_router_activation_func",
        "moe_renormalize", "routed_scaling_factor", "use_grouped_topk", "num_expert_group",
        "topk_group", "bos_token_id", "eos_token_id", "pad_token_id",
        # Kimi K3 blocks
        "activation_situ_beta", "activation_situ_linear_beta", "attn_res_block_size",
        "routed_expert_hidden_size", "latent_moe_use_norm", "mla_use_output_gate",
    }
)

# compressed-tensors formats of the routed experts that the loader understands
_EXPERT_FORMATS = {"mxfp4-pack-quantized": "mxfp4"}
# config.json model_type values ModelConfig reads (the registry maps them to model classes)
TEXT_MODEL_TYPES = ("kimi_linear", "kimi_k3", "kimi_k25")


def _require(raw: dict[str, Any], name: str) -> Any:
    if name not in raw or raw[name] is None:
        raise ConfigError(f"config.json: required field '{name}' is missing")
    return raw[name]


def _as_int(raw: dict[str, Any], name: str, default: int | None = None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ConfigError(f"config.json: required field '{name}' is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json: field '{name}' must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one hybrid KDA + MLA MoE model. Layer indices are 0-based."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # token mixers
    kda_layers: tuple[int, ...]
    mla_layers: tuple[int, ...]
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    rope_theta: float
    # feed-forward
    moe_layers: tuple[int, ...]
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    moe_router_activation_func: str
    moe_renormalize: bool
    routed_scaling_factor: float
    use_grouped_topk: bool
    num_expert_group: int
    topk_group: int
    # KDA gate variant of newer configs: g = lb * sigmoid(exp(A_log) * (raw + dt_bias))
    kda_gate_lower_bound: float | None = None
    max_position_embeddings: int = 1 << 20
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # ---- Kimi K3 (defaults: Kimi Linear) ----
    architecture: str = "kimi_linear"          # the registry's key: kimi_linear | kimi_k3 | kimi_k25
    hidden_act: str = "silu"                   # silu | situ
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    attn_res_block_size: int | None = None     # None: plain residual stream
    routed_expert_hidden_size: int | None = None   # latent MoE width, None: experts on hidden
    latent_moe_use_norm: bool = False
    kda_full_rank_gate: bool = False           # g_proj [HD, hidden] instead of g_a/g_b
    mla_use_output_gate: bool = False          # attn_out * sigmoid(g_proj(x)) before o_proj
    experts_quantization: str | None = None    # "mxfp4": routed experts stored packed
    media_placeholder_token_id: int | None = None
    vision_config: dict | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        layers = sorted(self.kda_layers + self.mla_layers)
        if layers != list(range(n)):
            raise ConfigError(
                "config.json: linear_attn_config 'kda_layers' and 'full_attn_layers' must together "
                f"cover layers 1..{n} exactly once, got kda={[i + 1 for i in self.kda_layers]} "
                f"full={[i + 1 for i in self.mla_layers]}"
            )
        for name in ("vocab_size", "hidden_size", "kda_num_heads", "kda_head_dim",
                     "num_attention_heads", "kv_lora_rank", "v_head_dim", "conv_kernel_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: field '{name}' must be positive")
        if self.qk_nope_head_dim + self.qk_rope_head_dim <= 0:
            raise ConfigError("config.json: 'qk_nope_head_dim' + 'qk_rope_head_dim' must be positive")
        if self.moe_layers:
            if self.num_experts <= 0:
                raise ConfigError("config.json: 'num_experts' must be positive for MoE layers")
            if not 0 < self.num_experts_per_token <= self.num_experts:
                raise ConfigError(
                    f"config.json: 'num_experts_per_token' ({self.num_experts_per_token}) must be in "
                    f"1..num_experts ({self.num_experts})"
                )
            if self.num_experts % self.num_expert_group:
                raise ConfigError(
                    f"config.json: 'num_experts' ({self.num_experts}) must be divisible by "
                    f"'num_expert_group' ({self.num_expert_group})"
                )
            if not 0 < self.topk_group <= self.num_expert_group:
                raise ConfigError(
                    f"config.json: 'topk_group' ({self.topk_group}) must be in 1..num_expert_group"
                )
            if self.moe_router_activation_func not in ("sigmoid", "softmax"):
                raise ConfigError(
                    "config.json: 'moe_router_activation_func' must be 'sigmoid' or 'softmax', got "
                    f"{self.moe_router_activation_func!r}"
                )
        if self.architecture not in TEXT_MODEL_TYPES:
            raise ConfigError(f"architecture must be one of {TEXT_MODEL_TYPES}, got "
                              f"{self.architecture!r}")
        if self.hidden_act not in ("silu", "situ"):
            raise ConfigError(f"config.json: 'hidden_act' must be 'silu' or 'situ', got "
                              f"{self.hidden_act!r}")
        for name in ("activation_situ_beta", "activation_situ_linear_beta",
                     "attn_res_block_size", "routed_expert_hidden_size"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"config.json: field '{name}' must be positive, got {v!r}")
        if self.experts_quantization not in (None, "mxfp4"):
            raise ConfigError(
                f"unsupported routed-expert quantization {self.experts_quantization!r}")
        if self.experts_quantization == "mxfp4" and self.moe_layers:
            width = self.routed_expert_hidden_size or self.hidden_size
            for name, v in (("expert input width", width),
                            ("moe_intermediate_size", self.moe_intermediate_size)):
                if v % 32:
                    raise ConfigError(f"config.json: MXFP4 experts need the {name} ({v}) to be "
                                      "a multiple of 32")

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Width of one cached MLA entry: normalised latent ‖ rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_conv_dim(self) -> int:
        return 3 * self.kda_num_heads * self.kda_head_dim

    @property
    def activation(self) -> GLUActivation:
        from kdaserve.ops.activation import GLUActivation
        if self.hidden_act == "silu":
            return GLUActivation()
        return GLUActivation("situ", self.activation_situ_beta or 1.0,
                             self.activation_situ_linear_beta)

    @property
    def expert_width(self) -> int:
        """The width routed experts run in: the latent width of a latent MoE, else hidden."""
        return self.routed_expert_hidden_size or self.hidden_size

    def layer_kind(self, layer: int) -> str:
        return "kda" if layer in self.kda_layers else "mla"

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    # ---- (de)serialisation ------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        p = Path(path)
        file = p / "config.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}")
        with open(file, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{file}: not valid JSON ({e})") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "kimi_linear")
        if model_type == "kimi_k3":
            return cls._from_k3_dict(raw)
        if model_type == "kimi_k25":
            return cls._from_k25_dict(raw)
        if model_type != "kimi_linear":
            raise ConfigError(
                f"config.json: 'model_type' is {model_type!r}; supported: "
                f"{', '.join(TEXT_MODEL_TYPES)}"
            )
        return cls._from_text_dict(raw)

    @classmethod
    def _from_k3_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """The K3 wrapper: text_config (or, as mlx-lm allows, a flat config) plus the top-level
        multimodal and quantization fields."""
        text = dict(raw.get("text_config") or
                    {k: v for k, v in raw.items() if k not in _K3_TOP_FIELDS})
        text.pop("model_type", None)
        qc = raw.get("quantization_config") or text.pop("quantization_config", None)
        text.pop("quantization_config", None)
        cfg = cls._from_text_dict(text)
        extra = {k: raw[k] for k in raw if k not in _K3_TOP_FIELDS and "text_config" in raw}
        if extra:
            raise ConfigError(f"config.json: unknown top-level field(s) "
                              f"{', '.join(map(repr, sorted(extra)))} for kimi_k3")
        return replace(
            cfg, architecture="kimi_k3", experts_quantization=_expert_format(qc),
            media_placeholder_token_id=raw.get("media_placeholder_token_id"),
            vision_config=raw.get("vision_config"),
            eos_token_id=cfg.eos_token_id or _eos_ids(raw.get("eos_token_id")))

    @classmethod
    def _from_k25_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """transformers' kimi_k25 (Kimi_K25ForConditionalGeneration) with a kimi_linear
        text_config; the projector's width and eps sit at the top level and are kept with the
        vision_config here. Its ties default to on, as in transformers."""
        text = dict(raw.get("text_config") or {})
        if text.get("model_type", "kimi_linear") != "kimi_linear":
            raise ConfigError(f"config.json: kimi_k25 with a {text.get('model_type')!r} "
                              "text_config is not supported; the text model must be kimi_linear")
        text.pop("model_type", None)
        text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True))
        cfg = cls._from_text_dict(text)
        vc = dict(raw.get("vision_config") or {})
        for src, dst in (("projection_hidden_size", "mm_hidden_size"),
                         ("projection_layer_norm_eps", "projector_ln_eps")):
            if raw.get(src) is not None:
                vc.setdefault(dst, raw[src])
        return replace(cfg, architecture="kimi_k25", vision_config=vc,
                       media_placeholder_token_id=raw.get("image_token_id", 163605),
                       eos_token_id=cfg.eos_token_id or _eos_ids(raw.get("eos_token_id")))

    @classmethod
    def _from_text_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        unknown = sorted(set(raw) - _IGNORED_FIELDS - _MODEL_FIELDS)
        if unknown:
            raise ConfigError(f"config.json: unknown field(s) {', '.join(map(repr, unknown))}")
        if raw.get("attention_bias"):
            raise ConfigError("config.json: 'attention_bias: true' is not supported")
        if raw.get("hidden_act", "silu") not in ("silu", "situ"):
            raise ConfigError(f"config.json: 'hidden_act' must be 'silu' or 'situ', got "
                              f"{raw['hidden_act']!r}")
        n_heads = _as_int(raw, "num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or n_heads
        if kv_heads != n_heads:
            raise ConfigError(
                f"config.json: 'num_key_value_heads' ({kv_heads}) must equal 'num_attention_heads' "
                "for MLA"
            )
        n_layers = _as_int(raw, "num_hidden_layers")
        kda, mla = _layer_split(raw, n_layers)
        lin = raw.get("linear_attn_config") or {}
        kda_heads = lin.get("num_heads", raw.get("linear_num_heads"))
        kda_dim = lin.get("head_dim", raw.get("linear_head_dim"))
        conv_k = lin.get("short_conv_kernel_size", raw.get("linear_conv_kernel_dim", 4))
        if kda and (kda_heads is None or kda_dim is None):
            raise ConfigError("config.json: 'linear_attn_config' needs 'num_heads' and 'head_dim'")
        for key, a, b in (("num_heads", lin.get("num_heads"), raw.get("linear_num_heads")),
                          ("head_dim", lin.get("head_dim"), raw.get("linear_head_dim"))):
            if a is not None and b is not None and a != b:
                raise ConfigError(
                    f"config.json: 'linear_attn_config.{key}' ({a}) disagrees with 'linear_{key}' ({b})"
                )
        num_experts = raw.get("num_experts", raw.get("num_local_experts", 0)) or 0
        moe = _moe_layers(raw, n_layers, num_experts)
        if raw.get("rope_scaling") and not raw.get("mla_use_nope", True):
            raise ConfigError("config.json: 'rope_scaling' is not supported")
        eos_ids = _eos_ids(raw.get("eos_token_id"))
        lb = raw.get("kda_gate_lower_bound", raw.get("gate_lower_bound",
                                                     lin.get("gate_lower_bound")))
        return cls(
            vocab_size=_as_int(raw, "vocab_size"),
            hidden_size=_as_int(raw, "hidden_size"),
            num_hidden_layers=n_layers,
            intermediate_size=_as_int(raw, "intermediate_size", 0),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            kda_layers=kda,
            mla_layers=mla,
            kda_num_heads=int(kda_heads or 1),
            kda_head_dim=int(kda_dim or 1),
            conv_kernel_size=int(conv_k),
            num_attention_heads=n_heads,
            kv_lora_rank=_as_int(raw, "kv_lora_rank"),
            q_lora_rank=raw.get("q_lora_rank"),
            qk_nope_head_dim=_as_int(raw, "qk_nope_head_dim"),
            qk_rope_head_dim=_as_int(raw, "qk_rope_head_dim"),
            v_head_dim=_as_int(raw, "v_head_dim"),
            # transformers' KimiLinear applies no rotary at all, which is what this flag means.
            mla_use_nope=bool(raw.get("mla_use_nope", True)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            moe_layers=moe,
            num_experts=int(num_experts),
            num_experts_per_token=int(
                raw.get("num_experts_per_token", raw.get("num_experts_per_tok", 1)) or 1
            ),
            num_shared_experts=int(raw.get("num_shared_experts", raw.get("n_shared_experts", 0)) or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 0) or 0),
            moe_router_activation_func=raw.get("moe_router_activation_func", "sigmoid"),
            moe_renormalize=bool(raw.get("moe_renormalize", raw.get("norm_topk_prob", True))),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            # transformers always applies the group mask; with one group it is a no-op.
            use_grouped_topk=bool(raw.get("use_grouped_topk", True)),
            num_expert_group=int(raw.get("num_expert_group", raw.get("n_group", 1)) or 1),
            topk_group=int(raw.get("topk_group", 1) or 1),
            kda_gate_lower_bound=None if lb is None else float(lb),
            max_position_embeddings=int(
                raw.get("model_max_length", raw.get("max_position_embeddings", 1 << 20))
            ),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
            hidden_act=raw.get("hidden_act", "silu"),
            activation_situ_beta=_opt_float(raw, "activation_situ_beta"),
            activation_situ_linear_beta=_opt_float(raw, "activation_situ_linear_beta"),
            attn_res_block_size=raw.get("attn_res_block_size"),
            routed_expert_hidden_size=raw.get("routed_expert_hidden_size"),
            latent_moe_use_norm=bool(raw.get("latent_moe_use_norm", False)),
            kda_full_rank_gate=bool(lin.get("use_full_rank_gate", False)),
            mla_use_output_gate=bool(raw.get("mla_use_output_gate", False)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json contents that kdaserve and the references read: transformers'
        KimiLinear for kimi_linear, mlx-lm's kimi_k3 (and llama.cpp's converter) for K3."""
        text = self._text_hf_dict()
        if self.architecture == "kimi_k25":
            return {"architectures": ["Kimi_K25ForConditionalGeneration"],
                    "model_type": "kimi_k25", "text_config": text,
                    "vision_config": self.vision_config,
                    "image_token_id": self.media_placeholder_token_id,
                    "tie_word_embeddings": self.tie_word_embeddings}
        if self.architecture != "kimi_k3":
            return text
        text["architectures"] = ["KimiLinearForCausalLM"]
        lin = text["linear_attn_config"]
        lin["use_full_rank_gate"] = self.kda_full_rank_gate
        if self.kda_gate_lower_bound is not None:
            lin["gate_lower_bound"] = self.kda_gate_lower_bound
        text.update(
            hidden_act=self.hidden_act, activation_situ_beta=self.activation_situ_beta,
            activation_situ_linear_beta=self.activation_situ_linear_beta,
            attn_res_block_size=self.attn_res_block_size,
            routed_expert_hidden_size=self.routed_expert_hidden_size,
            latent_moe_use_norm=self.latent_moe_use_norm,
            mla_use_output_gate=self.mla_use_output_gate)
        out: dict[str, Any] = {
            "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "text_config": text, "vision_config": self.vision_config,
            "media_placeholder_token_id": self.media_placeholder_token_id,
            "eos_token_id": text["eos_token_id"],
        }
        if self.experts_quantization == "mxfp4":
            out["quantization_config"] = {"quant_method": "compressed-tensors",
                                          "format": "mxfp4-pack-quantized"}
        return out

    def _text_hf_dict(self) -> dict[str, Any]:
        n = self.num_hidden_layers
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": n,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.conv_kernel_size,
            },
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": self.mla_use_nope,
            "rope_theta": self.rope_theta,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "first_k_dense_replace": min(self.moe_layers) if self.moe_layers else n,
            "moe_layer_freq": 1,
            "mlp_layer_types": ["sparse" if self.is_moe(i) else "dense" for i in range(n)],
            "moe_router_activation_func": self.moe_router_activation_func,
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "use_grouped_topk": self.use_grouped_topk,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "model_max_length": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1
            else self.eos_token_id[0],
            "pad_token_id": self.pad_token_id,
            "dtype": "float32",
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_K3_TOP_FIELDS = frozenset({
    "architectures", "model_type", "text_config", "vision_config", "media_placeholder_token_id",
    "quantization_config", "auto_map", "dtype", "torch_dtype", "transformers_version",
    "eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings", "use_cache",
    "_name_or_path", "ignore_index", "image_token_index",
})


def _eos_ids(eos: Any) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _opt_float(raw: dict[str, Any], name: str) -> float | None:
    v = raw.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"config.json: field '{name}' must be a number, got {v!r}")
    return float(v)


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


def _layer_split(raw: dict[str, Any], n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lin = raw.get("linear_attn_config") or {}
    from_lin = None
    if "kda_layers" in lin or "full_attn_layers" in lin:
        kda = tuple(int(i) - 1 for i in lin.get("kda_layers", []))
        mla = tuple(int(i) - 1 for i in lin.get("full_attn_layers", []))
        for i in kda + mla:
            if not 0 <= i < n_layers:
                raise ConfigError(
                    f"config.json: linear_attn_config layer {i + 1} outside 1..{n_layers} (1-based)"
                )
        from_lin = (tuple(sorted(kda)), tuple(sorted(mla)))
    types = raw.get("layer_types")
    from_types = None
    if types is not None:
        if len(types) != n_layers:
            raise ConfigError(
                f"config.json: 'layer_types' has {len(types)} entries for {n_layers} layers"
            )
        bad = [t for t in types if t not in ("linear_attention", "full_attention")]
        if bad:
            raise ConfigError(f"config.json: 'layer_types' has unknown entry {bad[0]!r}")
        from_types = (
            tuple(i for i, t in enumerate(types) if t == "linear_attention"),
            tuple(i for i, t in enumerate(types) if t == "full_attention"),
        )
    if from_lin and from_types and from_lin != from_types:
        raise ConfigError("config.json: 'layer_types' disagrees with 'linear_attn_config'")
    split = from_lin or from_types
    if split is None:
        raise ConfigError(
            "config.json: 'linear_attn_config' with 'kda_layers' and 'full_attn_layers' is required"
        )
    return split


def _moe_layers(raw: dict[str, Any], n_layers: int, num_experts: int) -> tuple[int, ...]:
    types = raw.get("mlp_layer_types")
    first_k = raw.get("first_k_dense_replace")
    freq = raw.get("moe_layer_freq", 1) or 1
    from_rule = None
    if num_experts and first_k is not None:
        from_rule = tuple(i for i in range(n_layers) if i >= first_k and i % freq == 0)
    elif not num_experts:
        from_rule = ()
    if types is not None:
        if len(types) != n_layers or any(t not in ("dense", "sparse") for t in types):
            raise ConfigError(
                f"config.json: 'mlp_layer_types' must list 'dense'/'sparse' for {n_layers} layers"
            )
        from_types = tuple(i for i, t in enumerate(types) if t == "sparse")
        if from_rule is not None and first_k is not None and from_rule != from_types:
            raise ConfigError(
                "config.json: 'mlp_layer_types' disagrees with 'first_k_dense_replace'/'moe_layer_freq'"
            )
        return from_types
    if from_rule is None:
        from_rule = tuple(i for i in range(n_layers) if i >= 1)
    return from_rule


@dataclass(frozen=True)
class CacheConfig:
    """How the hybrid cache is sized and shared."""

    block_size: int = 16
    cache_memory_bytes: int = 512 << 20
    # On CUDA: this fraction of the device's memory, less what is in use after loading, sizes
    # the cache instead of cache_memory_bytes (vLLM's --gpu-memory-utilization).
    gpu_memory_utilization: float | None = None
    num_blocks: int | None = None
    num_state_slots: int | None = None
    enable_prefix_caching: bool = True
    state_snapshot_budget_bytes: int | None = None
    state_snapshot_interval: int = 512
    # Offload tiers for evicted prefix-cache entries, fastest first: ("host",), ("disk",) or
    # ("host", "disk"); one byte cap per tier (or one for all); the disk tier's directory.
    offload_tiers: tuple[str, ...] = ()
    offload_bytes: tuple[int, ...] = ()
    offload_dir: str | None = None

    def __post_init__(self) -> None:
        self._check_offload()
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.cache_memory_bytes <= 0:
            raise ConfigError("cache memory must be positive")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks must be >= 1")
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ConfigError("num_state_slots must be >= 1")

    def _check_offload(self) -> None:
        tiers = tuple(self.offload_tiers)
        if not tiers:
            return
        if tiers not in (("host",), ("disk",), ("host", "disk")):
            raise ConfigError(f"offload tiers must be host, disk or host,disk, got {tiers}")
        if not self.enable_prefix_caching:
            raise ConfigError("offload keeps prefix-cache entries: it needs prefix caching on")
        if "disk" in tiers and not self.offload_dir:
            raise ConfigError("the disk offload tier needs a directory (offload_dir)")
        if len(self.offload_bytes) not in (0, 1, len(tiers)):
            raise ConfigError(f"give one offload size, or one per tier ({len(tiers)})")
        if any(b <= 0 for b in self.offload_bytes):
            raise ConfigError("offload sizes must be positive")

    def offload_capacities(self) -> tuple[int, ...]:
        """Bytes per offload tier (default: 4 GiB of host memory, 16 GiB of disk)."""
        given = tuple(self.offload_bytes)
        if len(given) == 1:
            given *= len(self.offload_tiers)
        return given or tuple(4 << 30 if t == "host" else 16 << 30 for t in self.offload_tiers)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int | None = None
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1")
        if self.max_model_len < 1:
            raise ConfigError("max_model_len must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes drafts and how many per step.

    method "dspark": the block drafter fed by the target's hidden states (`draft_model` is its
    directory; default: the `draft/` folder next to the target's weights). method "ngram":
    prompt lookup, no model (the longest earlier match of the last `ngram_max`..`ngram_min`
    tokens proposes what followed it).
    """

    method: str = "dspark"
    num_speculative_tokens: int = 7
    draft_model: str | None = None
    ngram_min: int = 2
    ngram_max: int = 4
    # per request and step, verify only the drafts that pay for themselves (measured acceptance
    # and step cost; engine/spec/adaptive.py); False: always num_speculative_tokens
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in ("dspark", "ngram"):
            raise ConfigError(f"speculative method must be 'dspark' or 'ngram', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ConfigError("num_speculative_tokens must be in [1, 32], got "
                              f"{self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("need 1 <= ngram_min <= ngram_max")


MOE_BACKENDS = ("auto", "reference", "grouped", "ep_all2all", "tp_sharded")
EXECUTORS = ("uni", "mp", "torchrun", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """The process layout (docs/parallelism.md). Ranks = max(tensor, expert, data) parallel
    size x pipeline parallel size: tensor parallelism shards attention heads, MLPs and the
    vocabulary; expert parallelism partitions the routed experts over the same ranks
    (attention is then replicated when tensor_parallel_size is 1, or data parallel: each rank
    runs its own requests' attention, when data_parallel_size equals expert_parallel_size);
    pipeline parallelism splits the decoder layers into stages, one rank each.
    `distributed_executor`: "mp" (one spawned process per rank, also used for a single rank
    when asked for), "uni" (in-process; one rank only), "torchrun" (torchrun started the
    ranks; chosen by itself when WORLD_SIZE > 1 is in the environment) or "ray" (one Ray actor
    per rank, on the cluster at `ray_address`)."""

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    # attention data parallel ("DEP"): each rank runs attention for its own requests, the
    # routed experts partitioned over the same ranks (expert_parallel_size == this)
    data_parallel_size: int = 1
    # pipeline parallel: the decoder layers split into this many stages, one rank each
    # (kdaserve/distributed/pipeline.py); only with the other sizes 1
    pipeline_parallel_size: int = 1
    moe_backend: str = "auto"
    distributed_executor: str | None = None    # None: torchrun's, else uni (1 rank) or mp
    worker_timeout_s: float = 300.0            # a collective that waits longer fails
    # "ray": the cluster to join (None: RAY_ADDRESS, else a local cluster started for us)
    ray_address: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "expert_parallel_size", "data_parallel_size",
                     "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if tp > 1 and ep > 1 and tp != ep:
            raise ConfigError(f"expert_parallel_size ({ep}) must be 1 or equal "
                              f"tensor_parallel_size ({tp}): experts are partitioned over the "
                              "tensor-parallel ranks")
        dp = self.data_parallel_size
        if dp > 1 and (tp != 1 or ep != dp):
            raise ConfigError(f"data_parallel_size {dp} is attention data parallel with "
                              f"expert-parallel MoE: it needs expert_parallel_size {dp} and "
                              f"tensor_parallel_size 1 (got {ep} and {tp})")
        pp = self.pipeline_parallel_size
        if pp > 1 and (tp, ep, dp) != (1, 1, 1):
            raise ConfigError(f"pipeline_parallel_size {pp} runs with tensor, expert and data "
                              f"parallel sizes 1 (got {tp}, {ep} and {dp}): combined layouts "
                              "are not built")
        if self.moe_backend not in MOE_BACKENDS:
            raise ConfigError(f"moe_backend must be one of {MOE_BACKENDS}, "
                              f"got {self.moe_backend!r}")
        if self.distributed_executor not in (None, *EXECUTORS):
            raise ConfigError(f"distributed_executor must be one of {EXECUTORS}, "
                              f"got {self.distributed_executor!r}")
        if self.distributed_executor == "uni" and self.world_size > 1:
            raise ConfigError("the in-process executor runs one rank; use 'mp' for "
                              f"{self.world_size} ranks")

    @property
    def world_size(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size,
                   self.data_parallel_size) * self.pipeline_parallel_size

    @property
    def executor(self) -> str:
        if self.distributed_executor:
            return self.distributed_executor
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:     # torchrun started us: its ranks
            return "torchrun"
        return "uni" if self.world_size == 1 else "mp"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    kda_chunk_size: int | None = None
    seed: int = 0
    num_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
