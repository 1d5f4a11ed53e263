"""compressed-tensors' pack-quantized tensors <-> the form kdaserve keeps (kdaserve/ops/
int_quant.py): `weight_packed` int32 words are viewed as their bytes, zero points packed along
the rows are unpacked to int8, `weight_shape` is checked and dropped on load and written on
save. MXFP4's `weight_packed` (already uint8) passes through unchanged."""

from __future__ import annotations

import torch

from kdaserve.model.checkpoint_files import CheckpointError
from kdaserve.ops.int_quant import (
    from_int32_words,
    pack_zero_points,
    to_int32_words,
    unpack_zero_points,
)
from kdaserve.quant_config import WeightQuant

SHAPE_SUFFIX = ".weight_shape"


def stored_form(name: str, t: torch.Tensor, rows: int | None,
                wq: WeightQuant | None) -> torch.Tensor:
    """Checkpoint tensor `name` as the model stores it (`rows`: the output rows it fills)."""
    if wq is None:
        return t
    if name.endswith(".weight_packed") and t.dtype == torch.int32:
        return from_int32_words(t)
    if name.endswith(".weight_zero_point"):
        if rows is None:
            raise CheckpointError(f"tensor '{name}': cannot size its zero points")
        return unpack_zero_points(t, wq.bits, rows)
    if name.endswith(".weight_scale") and t.dim() == 1:     # a per-tensor scale [1]
        raise CheckpointError(f"tensor '{name}': per-tensor scales are not supported")
    return t


def check_shape(name: str, t: torch.Tensor, params: dict[str, torch.Tensor],
                wq: WeightQuant | None) -> None:
    """A linear's `weight_shape` against the layer the model built (experts are checked by
    their packed tensors' shapes)."""
    if wq is None:
        raise CheckpointError(f"unexpected tensor '{name}' (the config.json has no "
                              "pack-quantized quantization_config)")
    packed = params.get(name[: -len(SHAPE_SUFFIX)] + ".weight_packed")
    if packed is None:
        return
    rows, cols = (int(v) for v in t.tolist())
    if rows != packed.shape[0] or (cols * wq.bits + 31) // 32 * 4 != packed.shape[1]:
        raise CheckpointError(f"tensor '{name}' says {rows}x{cols}, the model built "
                              f"{tuple(packed.shape)} packed bytes")


def checkpoint_form(name: str, t: torch.Tensor, k: int | None,
                    wq: WeightQuant | None) -> list[tuple[str, torch.Tensor]]:
    """A model tensor under its checkpoint name as compressed-tensors writes it (`k`: the
    layer's input width, for `weight_shape`)."""
    if wq is None or not name.endswith((".weight_packed", ".weight_zero_point")):
        return [(name, t)]
    if name.endswith(".weight_zero_point"):
        return [(name, pack_zero_points(t, wq.bits))]
    base = name[: -len(".weight_packed")]
    return [(name, to_int32_words(t)),
            (base + SHAPE_SUFFIX, torch.tensor([t.shape[0], k], dtype=torch.int64))]
