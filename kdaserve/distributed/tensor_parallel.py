"""Turn a model built on the meta device into one rank's share, before its weights are read.

Tensor parallelism (Megatron style): the KDA and MLA mixers keep num_heads / tp heads (their
input projections are column-parallel: q, k, v, conv, f_b, g, b, A_log and dt_bias sharded by
head; MLA's q and kv_b by head, its latent projection kv_a replicated so every rank writes the
same latent cache), their o_proj is row-parallel (a partial sum, all-reduced). Dense MLPs and
shared experts: gate/up column-parallel, down row-parallel. The embedding and the LM head are
vocab-parallel. Routed experts follow the MoE backend (kdaserve/model/moe_backends.py).

Each rank's parameters are built at their local shapes; the loader reads the matching slice
of each checkpoint tensor (a dimension whose size differs from the checkpoint's is split
evenly across the ranks; see kdaserve/model/loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.distributed.comm import all_gather_cat, all_reduce_
from kdaserve.distributed.layout import rank_model_config
from kdaserve.distributed.parallel_state import ParallelContext
from kdaserve.model.kda import KimiDeltaAttention
from kdaserve.model.layers import MLP
from kdaserve.model.mla import MultiHeadLatentAttention


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/tp) of the table; other ids embed to 0 here and come from the
    rank that holds them (all-reduce)."""

    def __init__(self, num_local: int, hidden: int, start: int, group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_local, hidden))
        self.start, self.num_local, self.group = start, num_local, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_local)
        out = F.embedding(local.clamp(0, self.num_local - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return all_reduce_(out, self.group)


class VocabParallelLMHead(nn.Linear):
    """Logits of this rank's vocabulary slice, gathered into the full row on every rank (the
    same bytes everywhere, so every rank samples the same token)."""

    def __init__(self, hidden: int, num_local: int, world: int, group=None) -> None:
        super().__init__(hidden, num_local, bias=False)
        self.world, self.group = world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_cat(F.linear(x, self.weight), self.world, -1, self.group)


def _reduce_output(module: nn.Module, group) -> None:
    """A row-parallel linear: its output is a partial sum until all-reduced."""
    module.register_forward_hook(lambda _m, _i, out: all_reduce_(out, group))


def _set_child(root: nn.Module, target: nn.Module, new: nn.Module) -> None:
    for name, mod in root.named_modules():
        for child_name, child in mod.named_children():
            if child is target:
                setattr(mod, child_name, new)
                return
    raise LookupError("module not found")


@dataclass(frozen=True)
class ShardInfo:
    """What the loader needs: which rank this is along tp and ep, and the routed experts held
    here (a range of global expert ids)."""

    tp_rank: int
    tp_size: int
    expert_start: int
    num_local_experts: int
    foreign: tuple[str, ...] = ()     # name prefixes other pipeline stages hold (not read)


def shard_model(model, ctx: ParallelContext, moe_backend: str = "auto") -> ShardInfo:
    """Rebuild (on meta) the modules of `model` at this rank's shapes. Returns ShardInfo."""
    from kdaserve.model.moe_backends import configure_moe

    cfg = model.config
    tp, group = ctx.tp_size, ctx.group
    rank_cfg = rank_model_config(cfg, tp)
    model._rank_config = rank_cfg
    foreign: tuple[str, ...] = ()
    if getattr(ctx, "pp_size", 1) > 1:       # a pipeline stage: its layers only
        from kdaserve.distributed.pipeline_model import keep_stage

        foreign = keep_stage(model, ctx)
    chunk = model.chunk_size
    for layer in model.model.layers:
        if tp > 1:
            attn = layer.self_attn
            if isinstance(attn, KimiDeltaAttention):
                new = KimiDeltaAttention(rank_cfg, attn.kda_index, chunk)
            else:
                assert isinstance(attn, MultiHeadLatentAttention)
                new = MultiHeadLatentAttention(rank_cfg, attn.mla_index)
            _reduce_output(new.o_proj, group)
            layer.self_attn = new
            if hasattr(layer, "mlp"):
                layer.mlp = MLP(cfg.hidden_size, cfg.intermediate_size // tp, cfg.activation)
                _reduce_output(layer.mlp.down_proj, group)
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            if tp > 1 and moe.shared_experts is not None:
                width = cfg.moe_intermediate_size * cfg.num_shared_experts
                moe.shared_experts = MLP(cfg.hidden_size, width // tp, cfg.activation)
                _reduce_output(moe.shared_experts.down_proj, group)
            start, n = configure_moe(moe, ctx, moe_backend)
    if tp > 1:
        v, h = cfg.vocab_size // tp, cfg.hidden_size
        emb = VocabParallelEmbedding(v, h, ctx.tp_rank * v, group)
        head = VocabParallelLMHead(h, v, tp, group)
        _set_child(model, model.lm_head, head)
        _set_child(model, model.model.embed_tokens, emb)
        if cfg.tie_word_embeddings:
            head.weight = emb.weight
    if not any(getattr(layer, "block_sparse_moe", None) is not None
               for layer in model.model.layers):    # none here (or on this stage)
        start, n = 0, cfg.num_experts
    return ShardInfo(ctx.tp_rank, tp, start, n, foreign)
