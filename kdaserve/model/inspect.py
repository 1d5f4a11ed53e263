"""`kdaserve inspect --model DIR|config.json`: the model's size without its weights.

Builds the model on the meta device (no memory, seconds even for the 2.8T K3 config) and counts
parameters by part: total, active per token (routed experts count top-k of E; everything else
counts whole), bytes as stored (MXFP4 experts: 4 bits plus one E8M0 byte per 32 weights; INT8 /
INT4 layers of a compressed-tensors config: their packed bytes plus fp32 group scales) and per
weight, and the cache sizes that decide how many requests fit: KDA state bytes per request
(constant in context
length) and MLA latent bytes per token.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field

import torch

from kdaserve.cache.spec import DTYPE_BYTES, specs_for
from kdaserve.model.base import FP32_PARAM_SUFFIXES
from kdaserve.model_config import ModelConfig

_PARTS = (
    ("routed experts", re.compile(r"\.experts_w(13|2)(_packed)?$")),
    ("expert scales", re.compile(r"\.experts_w(13|2)_(scale|zero_point)$")),
    ("router", re.compile(r"\.block_sparse_moe\.gate\.")),
    ("shared experts", re.compile(r"\.shared_experts\.")),
    ("latent MoE projections", re.compile(r"\.routed_expert_(down_proj|up_proj|norm)\.")),
    ("dense MLP", re.compile(r"\.mlp\.")),
    ("embedding", re.compile(r"embed_tokens\.")),
    ("LM head", re.compile(r"lm_head\.")),
)


@dataclass
class ModelSize:
    config: ModelConfig
    params: dict[str, int] = field(default_factory=dict)        # logical weights by part
    active: dict[str, float] = field(default_factory=dict)
    stored_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.params.values())

    @property
    def total_active(self) -> float:
        return sum(self.active.values())

    def bytes_per_weight(self) -> dict[str, float]:
        """Stored bytes over logical weights by part (the routed experts with their scales)."""
        out = {}
        for part, n in self.params.items():
            b = self.stored_bytes.get(part, 0) + (self.stored_bytes.get("expert scales", 0)
                                                  if part == "routed experts" else 0)
            out[part] = round(b / n, 4) if n else 0.0
        return out

    def cache_bytes(self, dtype: str) -> tuple[int, int]:
        """(KDA state bytes per request, MLA latent bytes per token) for cache dtype."""
        latent, state = specs_for(self.config, 16, dtype)
        return state.bytes_per_slot, latent.bytes_per_token

    def to_dict(self, cache_dtype: str) -> dict:
        state, lat = self.cache_bytes(cache_dtype)
        return {"architecture": self.config.architecture, "total_params": self.total,
                "active_params_per_token": int(self.total_active),
                "params_by_part": self.params,
                "active_by_part": {k: int(v) for k, v in self.active.items()},
                "stored_bytes_by_part": self.stored_bytes,
                "stored_bytes": sum(self.stored_bytes.values()),
                "bytes_per_weight_by_part": self.bytes_per_weight(),
                "cache_dtype": cache_dtype, "kda_state_bytes_per_request": state,
                "mla_latent_bytes_per_token": lat}


def _part(name: str, cfg: ModelConfig) -> str:
    for part, pattern in _PARTS:
        if pattern.search(name):
            return part
    m = re.search(r"layers\.(\d+)\.self_attn\.", name)
    if m:
        return "KDA" if cfg.layer_kind(int(m.group(1))) == "kda" else "MLA"
    return "norms and residual mixes"


def measure(cfg: ModelConfig, weight_dtype: str = "bfloat16") -> ModelSize:
    """Sizes of cfg's model as a checkpoint of `weight_dtype` stores it (built on meta)."""
    from kdaserve.model.registry import build_model

    with torch.device("meta"):
        model = build_model(cfg)
        if cfg.weight_quant is not None:
            from kdaserve.model.quantize import quantized_layout

            quantized_layout(model, cfg.weight_quant, torch.float32)
    return measure_model(model, cfg, DTYPE_BYTES[weight_dtype])


def measure_model(model: torch.nn.Module, cfg: ModelConfig,
                  weight_bytes: int | None = None) -> ModelSize:
    """Sizes by part of a built model: stored bytes as its tensors hold them, or with float
    weights of `weight_bytes` each (a checkpoint's dtype; fp32-kept ones stay 4)."""
    size = ModelSize(cfg)
    share = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 0.0
    bits = cfg.weight_quant.bits if cfg.weight_quant is not None else 8
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen:          # tied weights count once
            continue
        seen.add(id(t))
        part = _part(name, cfg)
        if name.endswith(("weight_scale", "weight_zero_point")):
            part_of = part          # a packed layer's scales: bytes of its part, no weights
            size.stored_bytes[part_of] = size.stored_bytes.get(part_of, 0) + (
                t.numel() * t.element_size())
            continue
        packed = t.dtype == torch.uint8
        if packed and part == "routed experts" and cfg.experts_quantization == "mxfp4":
            n = 2 * t.numel()
        elif packed:                # INT8 / INT4 bytes
            n = t.numel() * 8 // bits
        else:
            n = t.numel()
        if packed or weight_bytes is None:
            stored = t.numel() * t.element_size()
        else:
            stored = n * (4 if name.endswith(FP32_PARAM_SUFFIXES) else weight_bytes)
        size.stored_bytes[part] = size.stored_bytes.get(part, 0) + stored
        if part == "expert scales":
            continue
        size.params[part] = size.params.get(part, 0) + n
        size.active[part] = size.active.get(part, 0) + (n * share if part == "routed experts"
                                                        else n)
    return size


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def table(size: ModelSize, cache_dtype: str) -> str:
    rows = [("part", "params", "active/token", "stored", "bytes/weight")]
    per = size.bytes_per_weight()
    for part in sorted(size.stored_bytes, key=lambda p: -size.stored_bytes[p]):
        rows.append((part, _human(size.params.get(part, 0)), _human(size.active.get(part, 0)),
                     _bytes(size.stored_bytes[part]),
                     f"{per[part]:.3g}" if part in per else ""))
    total = sum(size.stored_bytes.values())
    rows.append(("total", _human(size.total), _human(size.total_active), _bytes(total),
                 f"{total / size.total:.3g}" if size.total else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    state, lat = size.cache_bytes(cache_dtype)
    cfg = size.config
    lines += ["", f"{cfg.architecture}: {cfg.num_hidden_layers} layers = "
              f"{len(cfg.kda_layers)} KDA + {len(cfg.mla_layers)} MLA; "
              f"{cfg.num_experts} experts, top-{cfg.num_experts_per_token}"
              + (f", routed experts {cfg.experts_quantization}" if cfg.experts_quantization
                 else "")
              + (f", {cfg.weight_quant.scheme} weights (group {cfg.weight_quant.group_size})"
                 if cfg.weight_quant is not None else ""),
              f"KDA state per request ({cache_dtype} conv windows, fp32 states): {_bytes(state)}"
              " (constant in context length)",
              f"MLA latents per token ({cache_dtype}): {_bytes(lat)}; "
              f"per 1M-token request: {_bytes(lat * (1 << 20))}"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or config.json")
    p.add_argument("--weight-dtype", default="bfloat16", choices=sorted(DTYPE_BYTES),
                   help="dtype of the unquantized weights, for the stored bytes")
    p.add_argument("--cache-dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    from kdaserve.model.registry import load_config

    cfg = load_config(args.model)
    size = measure(cfg, args.weight_dtype)
    if args.json:
        sys.stdout.write(json.dumps(size.to_dict(args.cache_dtype), indent=2) + "\n")
    else:
        sys.stdout.write(table(size, args.cache_dtype) + "\n")
    return 0
