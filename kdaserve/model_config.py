"""`ModelConfig`: the architecture of one hybrid KDA + MLA MoE model, validated.

Kept apart from `kdaserve.model` and torch-free: the cache bookkeeping, the scheduler and the
server read it, and those may import neither `model/` nor torch. Parsing an HF `config.json`
into it is per family (`kdaserve.model.configs`), chosen by `kdaserve.model.registry`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kdaserve.config import ConfigError
from kdaserve.quant_config import WeightQuant

if TYPE_CHECKING:  # the bookkeeping imports this module and stays free of torch
    from kdaserve.ops.activation import GLUActivation

# config.json model_type values a ModelConfig describes (the registry maps them to model classes)
TEXT_MODEL_TYPES = ("kimi_linear", "kimi_k3", "kimi_k25")


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
    # the registry's key: kimi_linear | kimi_k3 | kimi_k25
    architecture: str = "kimi_linear"
    hidden_act: str = "silu"                   # silu | situ
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    attn_res_block_size: int | None = None     # None: plain residual stream
    routed_expert_hidden_size: int | None = None   # latent MoE width, None: experts on hidden
    latent_moe_use_norm: bool = False
    kda_full_rank_gate: bool = False           # g_proj [HD, hidden] instead of g_a/g_b
    mla_use_output_gate: bool = False          # attn_out * sigmoid(g_proj(x)) before o_proj
    experts_quantization: str | None = None    # "mxfp4": routed experts stored packed
    weight_quant: WeightQuant | None = None    # INT8/INT4 weight-only linears (quant_config.py)
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
            raise ConfigError(
                "config.json: 'qk_nope_head_dim' + 'qk_rope_head_dim' must be positive")
        if self.moe_layers:
            if self.num_experts <= 0:
                raise ConfigError("config.json: 'num_experts' must be positive for MoE layers")
            if not 0 < self.num_experts_per_token <= self.num_experts:
                raise ConfigError(
                    f"config.json: 'num_experts_per_token' ({self.num_experts_per_token}) "
                    "must be in "
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
