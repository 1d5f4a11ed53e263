"""VisionConfig: the MoonViT tower and its projector, read from a checkpoint's `vision_config`.

Two spellings exist: transformers' `kimi_k25_vision` (`hidden_size`, `pos_emb_height`,
`rope_parameters`, ...; the projector's width and eps sit at the top level as
`projection_hidden_size` / `projection_layer_norm_eps`) and the released checkpoints'
(`vt_hidden_size`, `init_pos_emb_height`, `mm_hidden_size`, `projector_ln_eps`, ...). K3's
MoonViT-V2 adds `qkv_hidden_size`, `norm_type: rmsnorm`, bias switches, bilinear position
interpolation and the `patchmergerv2` projector (no pre-norm, a post RMSNorm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kdaserve.config import ConfigError

if TYPE_CHECKING:
    from kdaserve.model_config import ModelConfig

_SIZES = (("vt_hidden_size", "hidden_size"), ("vt_num_hidden_layers", "num_hidden_layers"))


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    text_hidden_size: int
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    merge_kernel: tuple[int, int] = (2, 2)
    qkv_hidden_size: int | None = None        # attention inner width (V2); None: hidden_size
    norm_type: str = "layernorm"              # layernorm | rmsnorm
    norm_eps: float = 1e-5
    attn_bias: bool = True
    linear_bias: bool = True                  # MLP and projector linears
    patch_embed_bias: bool = True
    pos_interp_mode: str = "bicubic"          # bicubic | bilinear
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"
    projector_type: str = "patchmerger"       # patchmerger | patchmergerv2
    projector_eps: float = 1e-5
    mm_hidden_size: int | None = None         # projector input width per patch (default hidden)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "text_hidden_size", "patch_size",
                     "pos_emb_height", "pos_emb_width"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"vision_config: '{name}' must be positive")
        if self.attn_width % self.num_attention_heads or self.head_dim % 4:
            raise ConfigError("vision_config: the attention width must split into heads whose "
                              "size is a multiple of 4 (2D rotary)")
        if self.norm_type not in ("layernorm", "rmsnorm"):
            raise ConfigError(f"vision_config: norm_type {self.norm_type!r} is not supported")
        if self.pos_interp_mode not in ("bicubic", "bilinear"):
            raise ConfigError(f"vision_config: position interpolation {self.pos_interp_mode!r} "
                              "is not supported")
        if self.projector_type not in ("patchmerger", "patchmergerv2"):
            raise ConfigError(f"vision_config: mm_projector_type {self.projector_type!r} is not "
                              "supported")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"vision_config: activation {self.hidden_act!r} is not supported")

    @property
    def attn_width(self) -> int:
        return self.qkv_hidden_size or self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.attn_width // self.num_attention_heads

    @property
    def merge_size(self) -> int:
        return self.merge_kernel[0] * self.merge_kernel[1]

    @classmethod
    def from_dict(cls, vc: dict[str, Any], text_hidden_size: int,
                  top: dict[str, Any] | None = None) -> VisionConfig:
        """vc: the checkpoint's vision_config; top: the top-level config (kimi_k25 keeps the
        projector's fields there)."""
        top = top or {}

        def pick(*names: str, default: Any = None) -> Any:
            for n in names:
                if vc.get(n) is not None:
                    return vc[n]
            return default

        merge = pick("merge_kernel_size", default=(2, 2))
        merge = (merge, merge) if isinstance(merge, int) else tuple(int(m) for m in merge)
        rope = vc.get("rope_parameters") or {}
        try:
            return cls(
                hidden_size=int(pick("vt_hidden_size", "hidden_size")),
                intermediate_size=int(pick("vt_intermediate_size", "intermediate_size")),
                num_hidden_layers=int(pick("vt_num_hidden_layers", "num_hidden_layers")),
                num_attention_heads=int(pick("vt_num_attention_heads", "num_attention_heads")),
                text_hidden_size=int(pick("text_hidden_size", default=text_hidden_size)),
                patch_size=int(pick("patch_size", default=14)),
                pos_emb_height=int(pick("init_pos_emb_height", "pos_emb_height", default=64)),
                pos_emb_width=int(pick("init_pos_emb_width", "pos_emb_width", default=64)),
                merge_kernel=merge,
                qkv_hidden_size=pick("qkv_hidden_size"),
                norm_type=str(pick("norm_type", default="layernorm")),
                norm_eps=float(pick("norm_eps", "layer_norm_eps", default=1e-5)),
                attn_bias=bool(pick("attn_bias", default=True)),
                linear_bias=bool(pick("linear_bias", default=True)),
                patch_embed_bias=bool(pick("patch_embed_proj_bias", default=True)),
                pos_interp_mode=str(pick("pos_emb_interpolation_mode", default="bicubic")),
                rope_theta=float(rope.get("rope_theta", pick("rope_theta", default=10000.0))),
                hidden_act=str(pick("activation_func", "hidden_act",
                                    default="gelu_pytorch_tanh")),
                projector_type=str(pick("mm_projector_type", default="patchmerger")),
                projector_eps=float(pick("projector_ln_eps", default=top.get(
                    "projection_layer_norm_eps", 1e-5))),
                mm_hidden_size=pick("mm_hidden_size", default=top.get("projection_hidden_size")),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"vision_config: {e}") from None


def vision_config_of(cfg: ModelConfig) -> VisionConfig | None:
    """None when the checkpoint names no vision tower (a text-only config, or a K3 config whose
    vision_config lacks the tower's sizes, as in the published text-only excerpts). Torch-free:
    the server's HTTP process asks it too."""
    vc = cfg.vision_config
    if not vc or not all(any(vc.get(n) is not None for n in names) for names in _SIZES):
        return None
    return VisionConfig.from_dict(vc, cfg.hidden_size)
