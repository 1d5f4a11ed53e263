"""The engine's dtype: `--dtype auto` resolved for the device, and what packed INT weights
ask of it on CPU (EngineArgs.to_engine_config's one call)."""

from __future__ import annotations

import logging
from typing import Any

from kdaserve.quant_config import is_pack_quantized

logger = logging.getLogger("kdaserve")


def resolve_dtype(dtype: str, device: str, packed: bool = False) -> str:
    """`auto`: bfloat16 on CUDA (the tensor cores' type, half the bytes a decode step reads),
    float32 on CPU (the compiled CPU kernels' type; torch's bf16 CPU products are slow).
    `packed` (INT8/INT4 weights on load or in the checkpoint): on CPU the packed kernels take
    float32 activations and keep the unquantized layers in float32 (the fused decode's _q
    blocks), so an explicit bfloat16 (or float16) is taken as float32: in bfloat16 the model
    fell back to the torch forward, which unpacks every weight each step (the memory-bound
    model: 8 tok/s against 330, docs/quantization.md)."""
    on_cpu = not str(device).startswith("cuda")
    if dtype in ("bfloat16", "float16") and packed and on_cpu:
        logger.warning("kdaserve dtype: INT8/INT4 weights on CPU run with float32 activations; "
                       "--dtype %s is taken as float32", dtype)
        return "float32"
    if dtype != "auto":
        return dtype
    return "float32" if on_cpu else "bfloat16"


def packed_int_weights(quantization: str | None, model: Any) -> bool:
    """Whether the model will hold packed INT weights: --quantization int8/int4, or a
    compressed-tensors pack-quantized checkpoint (its config.json says so)."""
    if quantization in ("int8", "int4"):
        return True
    from kdaserve.model.registry import read_config_json

    try:
        raw = read_config_json(model)
    except (OSError, TypeError, ValueError):   # ConfigError is a ValueError
        return False                 # the loader reports a missing or broken config
    return is_pack_quantized(raw.get("quantization_config"))
