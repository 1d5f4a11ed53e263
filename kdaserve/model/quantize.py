"""Weight-only INT8/INT4 applied to a model (kdaserve/quant_config.py says which linears):
the projections become `QuantLinear`s and the routed experts' stacks hold packed bytes.

Two entry points, one selection of layers:
- `quantized_layout(model, wq)`: before a compressed-tensors checkpoint loads (on the meta
  device): the targeted layers take the packed form, empty, for the loader to fill;
- `quantize_model(model, wq)`: `--quantization`: the loaded float weights are quantized in
  place (round to nearest; each float weight is freed as its packed form replaces it); the
  loader reads a bf16 checkpoint's floats as bf16 for it and `widen_unpacked` then puts the
  floats left over in the model's dtype, so the model is never all in fp32 at once.
The embedding and the routers stay as they are (not linears of the checkpoint's kind; the
router decides which experts run and is kept fp32 like transformers keeps it).
Legend: E experts, I expert width, W expert input width.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from kdaserve.model.moe import SparseMoE
from kdaserve.model.quant_linear import QuantLinear
from kdaserve.ops.int_quant import num_groups, quantize, row_bytes
from kdaserve.quant_config import WeightQuant

# the stacks' checkpoint names per expert (w1 | w3 fused in experts_w13)
_STACKS = (("experts_w13", "w1"), ("experts_w2", "w2"))


def _linears(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    """(checkpoint name, parent, attribute, layer) of every nn.Linear of the language model
    (the vision tower is left alone)."""
    for name, mod in list(model.named_modules()):
        if name.startswith(("vision_tower", "mm_projector")):
            continue
        for attr, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                yield (f"{name}.{attr}" if name else attr), mod, attr, child


# transformers names the dense layers' MLP like the MoE block (the loader's alias): a config
# written from its model names them so
_DENSE_MLP = re.compile(r"^((?:language_model\.)?model\.layers\.\d+\.)mlp\.")


def _applies(wq: WeightQuant, name: str) -> bool:
    return wq.applies(name, _DENSE_MLP.sub(r"\1block_sparse_moe.", name))


def _moes(model: nn.Module) -> Iterator[tuple[str, SparseMoE]]:
    for name, mod in model.named_modules():
        if isinstance(mod, SparseMoE):
            yield name, mod


def _experts_apply(wq: WeightQuant, prefix: str, moe: SparseMoE) -> bool:
    names = [f"{prefix}.experts.{e}.{p}" for e in range(moe.num_experts)
             for p in ("w1", "w2", "w3")]
    hits = {wq.applies(n) for n in names}
    if len(hits) > 1:
        raise ValueError(f"{prefix}: the quantization config targets some of its experts' "
                         "linears and not others; kdaserve stores an MoE layer's experts alike")
    return hits.pop()


def quantized_layout(model: nn.Module, wq: WeightQuant, dtype: torch.dtype) -> None:
    """The targeted layers in packed form, uninitialised, where the model was built."""
    for name, parent, attr, lin in _linears(model):
        if _applies(wq, name):
            setattr(parent, attr, QuantLinear(lin.in_features, lin.out_features, wq.bits,
                                              wq.group_size, wq.symmetric, dtype))
    for prefix, moe in _moes(model):
        if _experts_apply(wq, prefix, moe):
            if moe.quantized:
                raise ValueError(f"{prefix}: MXFP4 experts cannot also be INT-quantized")
            _int_expert_buffers(moe, wq)


@torch.no_grad()
def quantize_model(model: nn.Module, wq: WeightQuant, whole_groups: bool = False,
                   dtype: torch.dtype | None = None) -> nn.Module:
    """`model`'s targeted float weights replaced by their packed form; model.config records
    the quantization (what `save_model` writes and `kdaserve inspect` reads). A row whose
    width is not a multiple of the group ends in a shorter group, which kdaserve reads and
    compressed-tensors does not: `whole_groups` (a checkpoint for other tools) leaves such
    layers float instead and adds them to the config's `ignore`. `dtype`: the packed layers'
    compute dtype (default: their float weight's; the loader reads a bf16 checkpoint's weights
    as bf16 and quantizes them for an fp32 model)."""
    if getattr(model, "_rank_config", None) is not None:
        raise ValueError("weight quantization of a parallel rank's share is not supported")
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    skipped: list[str] = []
    for name, parent, attr, lin in _linears(model):
        if not _applies(wq, name):
            continue
        if whole_groups and lin.in_features % wq.group_size:
            skipped.append(name)
            continue
        w = lin.weight.detach()
        if emb is not None and w is emb.weight:     # tied head: the embedding stays float
            w = w.clone()
        setattr(parent, attr, QuantLinear.from_weight(w, wq.bits, wq.group_size,
                                                      wq.symmetric, dtype))
    for prefix, moe in _moes(model):
        if not _experts_apply(wq, prefix, moe) or moe.quantized:
            continue
        if whole_groups and (moe.width % wq.group_size or moe.intermediate % wq.group_size):
            skipped.append("re:" + re.escape(f"{prefix}.experts."))
            continue
        floats = {s: getattr(moe, s).detach() for s, _ in _STACKS}
        _int_expert_buffers(moe, wq)
        for stack, _ in _STACKS:
            src = floats.pop(stack)
            # expert by expert (the same groups, so the same bytes): quantize's fp32
            # temporaries stay one expert's, not a whole layer's (GBs at hidden 4096)
            for e in range(src.shape[0]):
                packed, scale, zero = quantize(src[e], wq.bits, wq.group_size, wq.symmetric)
                getattr(moe, f"{stack}_packed")[e].copy_(packed)
                getattr(moe, f"{stack}_scale")[e].copy_(scale)
                if zero is not None:
                    getattr(moe, f"{stack}_zero_point")[e].copy_(zero)
            del src
    if skipped:
        wq = replace(wq, ignore=wq.ignore + tuple(skipped))
    if hasattr(model, "config"):
        model.config = replace(model.config, weight_quant=wq)
    return model


def widen_unpacked(model: nn.Module, target: torch.dtype) -> None:
    """The floats that `--quantization` left unpacked, loaded as stored (bf16), in `target`
    (the same values: the widening is exact). Shared tensors (a tied head) stay shared."""
    done: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or not t.is_floating_point() or \
                        t.dtype.itemsize >= target.itemsize:
                    continue
                if id(t) not in done:
                    wide = t.detach().to(target)
                    done[id(t)] = (nn.Parameter(wide, requires_grad=t.requires_grad)
                                   if isinstance(t, nn.Parameter) else wide)
                table[name] = done[id(t)]


def _int_expert_buffers(moe: SparseMoE, wq: WeightQuant) -> None:
    """SparseMoE's INT form: `experts_w13_packed` uint8 [E, 2I, row_bytes(W)],
    `experts_w13_scale` fp32 [E, 2I, G(W)] (+ `experts_w13_zero_point` int8), likewise w2
    over I; the float stacks are dropped."""
    e, i, w = moe.num_experts, moe.intermediate, moe.width
    dev = moe.experts_w13.device
    for stack, shape in (("experts_w13", (e, 2 * i, w)), ("experts_w2", (e, w, i))):
        k = shape[2]
        g = num_groups(k, min(wq.group_size, k))
        delattr(moe, stack)
        moe.register_buffer(f"{stack}_packed", torch.zeros(
            *shape[:2], row_bytes(k, wq.bits), dtype=torch.uint8, device=dev))
        moe.register_buffer(f"{stack}_scale", torch.ones(*shape[:2], g, device=dev))
        if not wq.symmetric:
            moe.register_buffer(f"{stack}_zero_point", torch.zeros(
                *shape[:2], g, dtype=torch.int8, device=dev))
    moe.quantized = True
    moe.int_quant = wq
    moe._dequant = None
