"""Block-scaled FP8 checkpoints (`quantization_config.quant_method: fp8`, DeepSeek-V3's layout:
kdaserve/ops/fp8_block.py) read by the loader: each fp8 `weight` is paired with its
`weight_scale_inv`, whichever comes first in the files, and handed on dequantized, so the model
holds it in the engine's dtype (or quantizes it again with --quantization)."""

from __future__ import annotations

from typing import Any

import torch

from kdaserve.model.checkpoint_files import CheckpointError
from kdaserve.ops.fp8_block import dequantize_fp8_blocks

_SCALE = ".weight_scale_inv"
# safetensors' names of the fp8 dtypes
_FP8_DTYPES = ("F8_E4M3", "float8_e4m3fn")


def block_size(raw_config: dict[str, Any]) -> tuple[int, int] | None:
    """The (bh, bw) blocks of an fp8 block-scaled config, or None for any other config."""
    qc = raw_config.get("quantization_config") or (raw_config.get("text_config") or {}).get(
        "quantization_config")
    if not qc or qc.get("quant_method") != "fp8":
        return None
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"fp8 format {qc.get('fmt')!r} is not supported (e4m3)")
    size = qc.get("weight_block_size")
    if not size or len(size) != 2:
        raise CheckpointError("fp8 checkpoints without weight_block_size (per-tensor scales) "
                              "are not supported")
    return int(size[0]), int(size[1])


class FP8Pairs:
    """Pairs fp8 weights with their scales as the loader meets them."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}

    def feed(self, name: str, handle) -> list[tuple[str, torch.Tensor | None]]:
        """What the loader places now for checkpoint tensor `name`: the tensor itself to read
        (a plain one: [(name, None)]), nothing yet (half a pair), or a dequantized weight."""
        if name.endswith(_SCALE):
            base = name[: -len(_SCALE)]
            self.scales[base] = handle.get_tensor(name)
        elif name.endswith(".weight") and str(handle.get_slice(name).get_dtype()) in _FP8_DTYPES:
            base = name[: -len(".weight")]
            self.weights[base] = handle.get_tensor(name)
        else:
            return [(name, None)]
        if base in self.weights and base in self.scales:
            w = dequantize_fp8_blocks(self.weights.pop(base), self.scales.pop(base), self.block)
            return [(base + ".weight", w)]
        return []

    def finish(self) -> None:
        if self.weights or self.scales:
            missing = sorted(self.weights.keys() ^ self.scales.keys())[:3]
            raise CheckpointError(f"fp8 weights and weight_scale_inv do not pair up: {missing}")
