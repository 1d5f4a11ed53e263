"""The collectives the model uses, each a no-op when the group has one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over the ranks, in place (the result is the same on every rank)."""
    dist.all_reduce(t, group=group)
    return t


def all_gather_cat(t: torch.Tensor, world: int, dim: int = -1, group=None) -> torch.Tensor:
    """Equal-shaped shards of every rank, concatenated along `dim` in rank order."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def all_to_all_rows(t: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                    group=None) -> torch.Tensor:
    """Rows [N, ...] split by `send_counts` go to ranks 0..; returns what the ranks sent here,
    in rank order ([sum recv_counts, ...])."""
    out = t.new_empty((sum(recv_counts),) + tuple(t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), recv_counts, send_counts, group=group)
    return out


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """counts [world] (what this rank sends to each) -> what each rank sends to this one."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def union_failures(failures: list, group=None) -> list:
    """Cache-operation failures of every rank, each once (by entry and request), the same
    list on every rank: a load that failed on one rank leaves its request out of the step on
    all of them, so that they run the same rows (and the same collectives)."""
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, failures, group=group)
    seen, out = set(), []
    for rank_failures in gathered:
        for f in rank_failures:
            key = (f.tier, f.kind, f.key, f.request_id)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def send_frames(frames: list, dst: int, group=None) -> None:
    """Raw byte buffers to rank `dst`, as one message (it knows their sizes: recv_frames)."""
    if sum(len(f) for f in frames):
        joined = bytearray(b"".join(frames))
        dist.send(torch.frombuffer(joined, dtype=torch.uint8), dst, group=group)


def recv_frames(sizes: list[int], src: int, group=None) -> list[memoryview]:
    """What rank `src` sent with send_frames, as buffers of these sizes."""
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    if sizes and buf.numel():
        dist.recv(buf, src, group=group)
    view, out, at = memoryview(buf.numpy()), [], 0
    for n in sizes:
        out.append(view[at:at + n])
        at += n
    return out
