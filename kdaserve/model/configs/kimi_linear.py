"""HF `config.json` of `model_type: kimi_linear` <-> ModelConfig.

Two shapes are found in the wild: the released checkpoints' (`linear_attn_config`,
`first_k_dense_replace`, ...) and what transformers 5.x `save_pretrained` writes (adds
`layer_types`, `mlp_layer_types`, `linear_num_heads`, ...). Both are checked against each other
when both are present. The other families wrap this text config (kimi_k3.py, kimi_k25.py).
"""

from __future__ import annotations

from typing import Any

from kdaserve.config import ConfigError
from kdaserve.model_config import ModelConfig

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


def parse(raw: dict[str, Any]) -> ModelConfig:
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
    eos_ids = eos_token_ids(raw.get("eos_token_id"))
    lb = raw.get("kda_gate_lower_bound", raw.get("gate_lower_bound",
                                                 lin.get("gate_lower_bound")))
    return ModelConfig(
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


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    n = cfg.num_hidden_layers
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": n,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in cfg.kda_layers],
            "full_attn_layers": [i + 1 for i in cfg.mla_layers],
            "num_heads": cfg.kda_num_heads,
            "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": cfg.conv_kernel_size,
        },
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": cfg.mla_use_nope,
        "rope_theta": cfg.rope_theta,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "first_k_dense_replace": min(cfg.moe_layers) if cfg.moe_layers else n,
        "moe_layer_freq": 1,
        "mlp_layer_types": ["sparse" if cfg.is_moe(i) else "dense" for i in range(n)],
        "moe_router_activation_func": cfg.moe_router_activation_func,
        "moe_renormalize": cfg.moe_renormalize,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "use_grouped_topk": cfg.use_grouped_topk,
        "num_expert_group": cfg.num_expert_group,
        "topk_group": cfg.topk_group,
        "model_max_length": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if len(cfg.eos_token_id) != 1
        else cfg.eos_token_id[0],
        "pad_token_id": cfg.pad_token_id,
        "dtype": "float32",
    }


def eos_token_ids(eos: Any) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _as_int(raw: dict[str, Any], name: str, default: int | None = None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ConfigError(f"config.json: required field '{name}' is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json: field '{name}' must be an integer, got {value!r}")
    return value

def _opt_float(raw: dict[str, Any], name: str) -> float | None:
    v = raw.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"config.json: field '{name}' must be a number, got {v!r}")
    return float(v)

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
                "config.json: 'mlp_layer_types' disagrees with "
                "'first_k_dense_replace'/'moe_layer_freq'"
            )
        return from_types
    if from_rule is None:
        from_rule = tuple(i for i in range(n_layers) if i >= 1)
    return from_rule
