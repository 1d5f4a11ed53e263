"""Sizes of the two kinds of cache entry, in bytes (no torch: plain arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class LatentKVSpec:
    """MLA pages: per MLA layer a [num_blocks, block_size, latent_dim] tensor."""

    num_layers: int
    block_size: int
    latent_dim: int
    dtype_bytes: int
    # --kv-cache-dtype fp8: a token is its latent in e4m3 and a 4-byte scale
    # (kdaserve/ops/fp8_latents.py); dtype_bytes is then 1 and latent_dim counts the scale
    fp8: bool = False

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.latent_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token


@dataclass(frozen=True)
class KDAStateSpec:
    """KDA slots: per KDA layer a recurrent state [H, K, V] fp32 and a conv window."""

    num_layers: int
    num_heads: int
    head_dim: int
    conv_width: int          # kernel - 1
    conv_dim: int            # 3 * H * D
    dtype_bytes: int

    @property
    def bytes_per_slot(self) -> int:
        recurrent = self.num_heads * self.head_dim * self.head_dim * 4
        conv = self.conv_width * self.conv_dim * self.dtype_bytes
        return self.num_layers * (recurrent + conv)


FP8_SCALE_BYTES = 4


def specs_for(cfg, block_size: int, dtype: str, kv_cache_dtype: str = "auto"
              ) -> tuple[LatentKVSpec, KDAStateSpec]:
    """Both specs of a ModelConfig `cfg` (duck-typed to keep cache/ free of model imports).
    kv_cache_dtype "fp8": the MLA latents in e4m3 with a scale per token."""
    nbytes = DTYPE_BYTES[dtype]
    if kv_cache_dtype == "fp8":
        latent = LatentKVSpec(len(cfg.mla_layers), block_size,
                              cfg.mla_latent_dim + FP8_SCALE_BYTES, 1, fp8=True)
    else:
        latent = LatentKVSpec(len(cfg.mla_layers), block_size, cfg.mla_latent_dim, nbytes)
    state = KDAStateSpec(len(cfg.kda_layers), cfg.kda_num_heads, cfg.kda_head_dim,
                         cfg.conv_kernel_size - 1, cfg.kda_conv_dim, nbytes)
    return latent, state
