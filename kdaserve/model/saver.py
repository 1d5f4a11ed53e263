"""Save a model as an HF-format checkpoint (config.json + model.safetensors) under the released
checkpoint's names: stacked experts split per expert, INT8/INT4 layers as compressed-tensors
pack-quantized tensors (what `kdaserve.model.loader` and other tools read back)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from kdaserve.model import ct_checkpoint
from kdaserve.model.base import FP32_PARAM_SUFFIXES, HybridForCausalLM
from kdaserve.model.expert_names import STACK_SUFFIX, expert_slice
from kdaserve.model.registry import hf_config


def save_model(model: HybridForCausalLM, out: str | os.PathLike,
               dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors with the released checkpoint's names."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    wq = model.config.weight_quant
    for name, t in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach()
        if dtype is not None and t.is_floating_point() and not name.endswith(FP32_PARAM_SUFFIXES):
            t = t.to(dtype)
        pieces = [ct for out_name, piece in _checkpoint_pieces(name, t)
                  for ct in ct_checkpoint.checkpoint_form(
                      out_name, piece, _in_width(model, name, out_name), wq)]
        for out_name, piece in pieces:
            piece = piece.contiguous().cpu()
            if piece.untyped_storage().nbytes() != piece.nbytes:  # a view (fused weights)
                piece = piece.clone()
            state[out_name] = piece
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = hf_config(model.config)
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)


def _in_width(model: HybridForCausalLM, name: str, out_name: str) -> int | None:
    """The input width of the linear a packed tensor belongs to (its `weight_shape`)."""
    if not name.endswith("_packed") or model.config.weight_quant is None:
        return None
    mod = model.get_submodule(name.rsplit(".", 1)[0])
    if ".experts." in out_name:
        return mod.intermediate if ".w2." in out_name else mod.width
    return mod.in_features


def _checkpoint_pieces(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A model tensor under the released checkpoint's names (stacked experts split apart)."""
    for base, parts in ((".experts_w13", ("w1", "w3")), (".experts_w2", ("w2",))):
        for kind, stack_suffix in STACK_SUFFIX.items():
            suffix = base + stack_suffix
            if name.endswith(suffix):
                prefix = name[: -len(suffix)]
                return [(f"{prefix}.experts.{e}.{p}.{kind}", expert_slice(t, e, p))
                        for e in range(t.shape[0]) for p in parts]
    return [(name, t)]
