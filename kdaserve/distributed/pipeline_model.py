"""What one pipeline stage holds of the model and computes: its decoder layers (under their
global names, so the loader reads exactly their checkpoint tensors), the embedding on the first
stage, the final norm and LM head (and K3's output attention-residual mix) on the last.

Cache lists are per stage: a stage's KDA and MLA layers are renumbered 0.. in layer order, so
its HybridCache holds only its own layers' states and pages (the stage's model config,
kdaserve/distributed/layout.py stage_model_config, sizes them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kdaserve.distributed.layout import rank_model_config, stage_layers, stage_model_config
from kdaserve.model.attn_res import ResidualBank
from kdaserve.model.batch import ForwardBatch
from kdaserve.model.kda import KimiDeltaAttention


class StageLayers(nn.Module):
    """The decoder layers one stage holds, registered under their global indices (parameter
    names stay `model.layers.{i}.`); iterates its layers in order, indexed by global index."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for i, layer in layers.items():
            self.add_module(str(i), layer)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> nn.Module:
        return self._modules[str(i)]


@dataclass(frozen=True)
class Stage:
    index: int
    size: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1


def stage_of(model, ctx) -> Stage:
    pp = ctx.pp_size
    return Stage(ctx.pp_rank, pp, stage_layers(model.config.num_hidden_layers, pp, ctx.pp_rank))


def keep_stage(model, ctx) -> tuple[str, ...]:
    """Cut `model` (on the meta device, before loading) down to this stage's share. Returns
    the name prefixes of what other stages hold (the loader skips those tensors unread)."""
    cfg = model.config
    stage = stage_of(model, ctx)
    names = {id(m): n for n, m in model.named_modules()}
    foreign: list[str] = []

    def drop(module: nn.Module | None) -> None:
        if module is None:
            return
        name = names[id(module)]
        foreign.append(name + ".")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, None)

    held = {}
    for i, layer in enumerate(model.model.layers):
        if i in stage.layers:
            held[i] = layer
        else:
            foreign.append(names[id(layer)] + ".")
    model.model.layers = StageLayers(held)
    kda = mla = 0
    for layer in model.model.layers:        # this stage's cache lists, in layer order
        if isinstance(layer.self_attn, KimiDeltaAttention):
            layer.self_attn.kda_index, kda = kda, kda + 1
        else:
            layer.self_attn.mla_index, mla = mla, mla + 1
    # a tied LM head reads the embedding table: the last stage keeps it too
    if not stage.first and not (stage.last and cfg.tie_word_embeddings):
        drop(model.model.embed_tokens)
    if not stage.last:
        drop(model.model.norm)
        drop(model.lm_head)
        for name in ("output_attn_res_norm", "output_attn_res_proj"):
            drop(getattr(model.model, name, None))
    if not stage.first and hasattr(model, "drop_vision"):
        model.drop_vision()                  # images are embedded before the first layer
    model._rank_config = stage_model_config(rank_model_config(cfg, 1), stage.layers)
    return tuple(foreign)


def bank_depth(cfg, layer: int) -> int:
    """Block sums banked before `layer` (K3: a block-start layer, index % block size == 0,
    banks the running sum; kdaserve/model/kimi_k3.py)."""
    bs = cfg.attn_res_block_size
    return 0 if bs is None else -(-layer // bs)


@dataclass
class Carry:
    """What passes from one stage to the next for one micro-batch: the stream [T, H] and,
    with attention-residuals, the banked block sums [n, T, H] and their inverse RMS [n, T]
    (sent rather than recomputed, so each stage mixes exactly the same numbers)."""

    hidden: torch.Tensor
    bank_raw: torch.Tensor | None = None
    bank_inv_rms: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.hidden, self.bank_raw, self.bank_inv_rms) if t is not None]

    @classmethod
    def empty(cls, model, stage: Stage, num_tokens: int, device: torch.device) -> Carry:
        """Receive buffers for the carry into `stage`."""
        h = model.config.hidden_size
        hidden = torch.empty(num_tokens, h, dtype=model.dtype, device=device)
        n = bank_depth(model.config, stage.layers.start)
        if model.new_bank() is None or n == 0:
            return cls(hidden)
        return cls(hidden, torch.empty(n, num_tokens, h, dtype=model.dtype, device=device),
                   torch.empty(n, num_tokens, dtype=torch.float32, device=device))

    def bank(self, model) -> ResidualBank | None:
        bank = model.new_bank()
        if bank is not None and self.bank_raw is not None:
            bank.raw = list(self.bank_raw.unbind(0))
            bank.inv_rms = list(self.bank_inv_rms.unbind(0))
        return bank

    @classmethod
    def of(cls, hidden: torch.Tensor, bank: ResidualBank | None) -> Carry:
        if bank is None or not bank.raw:
            return cls(hidden.contiguous())
        return cls(hidden.contiguous(), torch.stack(bank.raw), torch.stack(bank.inv_rms))


def run_stage(model, stage: Stage, ids: torch.Tensor, fb: ForwardBatch, carry: Carry | None,
              embeds: torch.Tensor | None = None) -> Carry | torch.Tensor:
    """This stage's layers over one micro-batch: the carry for the next stage, or on the last
    stage the logits of fb.logits_indices (what HybridForCausalLM.forward returns). `embeds`:
    the first stage's input embeddings when images are scattered in (else ids are embedded)."""
    if stage.first:
        x = embeds if embeds is not None else model.model.embed_tokens(ids)
        bank = model.new_bank()
    else:
        x, bank = carry.hidden, carry.bank(model)
    x = model.run_stage(x, fb, stage.layers, bank)
    if not stage.last:
        return Carry.of(x, bank)
    x = model.final_hidden(x, bank)
    if fb.logits_indices is not None:
        x = x[fb.logits_indices]
    return model.lm_head(model.model.norm(x))
