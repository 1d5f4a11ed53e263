"""How a MoE layer runs its routed experts, behind one registry.

- `reference`: a loop over the experts, one matmul pair each (the test oracle);
- `grouped`: slots grouped by expert and run together (on CUDA the grouped Triton GEMMs,
  kdaserve/ops/gpu/moe_grouped.py; on CPU the compiled ragged-group kernel; else per-expert
  / padded batched matmuls; SparseMoE._routed);
- `tp_sharded`: every expert's width split over the tensor-parallel ranks (w1/w3 column-,
  w2 row-parallel), the grouped path on the local shard, the partial sums all-reduced;
- `ep_all2all`: the experts partitioned over the ranks; each rank dispatches its share of the
  (token, expert) slots to the experts' owners with all_to_all, the owners run them grouped
  and weighted, a second all_to_all returns the rows, and the token shards are all-gathered.
  No capacity limit: every slot is computed, whatever the routing. Under attention data
  parallelism (`moe.tokens_local`) each rank's tokens are its own: it dispatches all of them
  and keeps the result (no gather); a rank without tokens still joins with empty tensors.

`auto` picks by topology, as the reference deployment does: EP > 1 -> ep_all2all, TP > 1 ->
tp_sharded, one rank -> grouped. The choice and its reason are logged once per process.

Legend: T tokens, k experts per token, N slots, W expert input width, E experts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from kdaserve.distributed.comm import all_gather_cat, all_reduce_, all_to_all_rows, exchange_counts

logger = logging.getLogger("kdaserve")

Backend = Callable[..., torch.Tensor]   # (moe, x [T,W], weights [T,k], ids [T,k]) -> [T,W]


def reference(moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e in range(moe.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            y = moe._expert_mlp(x[tok], *moe._expert(e, x.dtype))
            out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
    return out


def grouped(moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return moe._routed(x, weights, ids)


def tp_sharded(moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return all_reduce_(moe._routed(x, weights, ids), moe.parallel_group)


def ep_all2all(moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    ep, rank, group = moe.ep_size, moe.ep_rank, moe.parallel_group
    el = moe.num_experts                         # experts held here
    T, k = ids.shape
    local = getattr(moe, "tokens_local", False)
    # every rank holds the same tokens (replicated or tensor-parallel attention): each takes
    # an even share of them to dispatch; data-parallel ranks each dispatch all of their own
    bounds = [T * r // ep for r in range(ep + 1)]
    lo, hi = (0, T) if local else (bounds[rank], bounds[rank + 1])
    flat_ids = ids[lo:hi].reshape(-1)                                       # [N]
    dest = torch.div(flat_ids, el, rounding_mode="floor")
    order = dest.argsort(stable=True)
    send = torch.bincount(dest, minlength=ep)
    recv = exchange_counts(send, group)
    send_l, recv_l = send.tolist(), recv.tolist()
    token = lo + torch.div(order, k, rounding_mode="floor")
    rows = all_to_all_rows(x[token], send_l, recv_l, group)                 # [Nr,W]
    meta = torch.stack([(flat_ids[order] - dest[order] * el).to(torch.float64),
                        weights[lo:hi].reshape(-1)[order].to(torch.float64)], 1)
    meta = all_to_all_rows(meta, send_l, recv_l, group)                     # [Nr,2]
    local_ids = meta[:, 0].long().unsqueeze(1)
    y = (moe._routed(rows, meta[:, 1:].to(weights.dtype), local_ids) if rows.shape[0]
         else rows)                                                         # weighted [Nr,W]
    back = all_to_all_rows(y, recv_l, send_l, group)                        # [N,W], my order
    shard = T if local else max(b - a for a, b in zip(bounds, bounds[1:]))
    mine = x.new_zeros(shard, x.shape[1])                                   # [S,W]
    mine.index_add_(0, token - lo, back)
    if local:
        return mine
    full = all_gather_cat(mine, ep, 0, group)                               # [ep*S,W]
    return torch.cat([full[r * mine.shape[0]: r * mine.shape[0] + bounds[r + 1] - bounds[r]]
                      for r in range(ep)], 0)


BACKENDS: dict[str, Backend] = {"reference": reference, "grouped": grouped,
                                "tp_sharded": tp_sharded, "ep_all2all": ep_all2all}


def choose(name: str, tp: int, ep: int) -> tuple[str, str]:
    """(backend, reason) for `--moe-backend name` on this topology."""
    if name != "auto":
        return name, "asked for"
    if ep > 1:
        return "ep_all2all", f"experts are spread over {ep} ranks (expert parallel)"
    if tp > 1:
        return "tp_sharded", f"tensor parallel size {tp}: every expert sharded by width"
    return "grouped", "one rank: all experts here, grouped by expert"


_LOGGED: set[tuple[str, str]] = set()


def configure_moe(moe, ctx, name: str = "auto") -> tuple[int, int]:
    """Set `moe`'s backend for this rank (on the meta device, before loading) and rebuild its
    expert stacks at the local shapes. Returns (first expert held, number held)."""
    tp, ep = ctx.tp_size, ctx.ep_size
    backend, why = choose(name, tp, ep)
    if (backend, why) not in _LOGGED:
        _LOGGED.add((backend, why))
        logger.info("kdaserve MoE backend: %s (%s)", backend, why)
    moe.routed_backend = BACKENDS[backend]
    moe.parallel_group = ctx.group
    moe.ep_size, moe.ep_rank = ep, ctx.ep_rank
    moe.tokens_local = getattr(ctx, "dp_size", 1) > 1
    e, i = moe.num_experts, moe.intermediate
    start, n = 0, e
    if backend == "ep_all2all":
        n = e // ep
        start = ctx.ep_rank * n
    elif backend == "tp_sharded":
        i = i // tp
    if (start, n, i) != (0, moe.num_experts, moe.intermediate):
        _resize_experts(moe, n, i)
    return start, n


def _resize_experts(moe, n: int, i: int) -> None:
    w = moe.width
    moe.num_experts, moe.intermediate = n, i
    if moe.quantized:
        from kdaserve.ops.mxfp4 import GROUP

        for name, shape in (("experts_w13", (n, 2 * i, w)), ("experts_w2", (n, w, i))):
            setattr(moe, f"{name}_packed",
                    torch.zeros(*shape[:2], shape[2] // 2, dtype=torch.uint8))
            setattr(moe, f"{name}_scale",
                    torch.zeros(*shape[:2], shape[2] // GROUP, dtype=torch.uint8))
    else:
        moe.experts_w13 = nn.Parameter(torch.empty(n, 2 * i, w))
        moe.experts_w2 = nn.Parameter(torch.empty(n, w, i))


def set_moe_backend(model: nn.Module, name: str) -> None:
    """One process holding every expert: `reference` or `grouped` (auto: grouped)."""
    from kdaserve.distributed.parallel_state import ParallelContext

    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            configure_moe(moe, ParallelContext(0, 1, 1, 1), name)
