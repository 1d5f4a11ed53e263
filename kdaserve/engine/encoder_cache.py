"""The encoder cache: image embeddings by content hash, so an image is encoded once however
many requests, chunks or steps need it; and the scatter of those embeddings into a step's input.

Entries are kept least-recently-used under a byte budget. An entry evicted while a request
still has placeholders to prefill is simply encoded again from the pixels the step carries
(every ScheduledSequence brings the MediaItems its chunk overlaps), so eviction never loses
anything, and a chunk boundary inside an image's run is just a row slice of its embeddings.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from kdaserve.media import MediaItem
from kdaserve.outputs import ScheduledSequence


class EncoderCache:
    def __init__(self, capacity_bytes: int = 256 << 20) -> None:
        self.capacity = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.num_encoded = 0          # images run through the encoder
        self.num_hits = 0             # lookups served from the cache

    def __contains__(self, h: str) -> bool:
        return h in self._entries

    def get(self, items: Sequence[MediaItem], model: torch.nn.Module,
            device: torch.device) -> dict[str, torch.Tensor]:
        """Embeddings [num_tokens, hidden] of each distinct item; the missing ones encoded
        together in one packed pass."""
        out: dict[str, torch.Tensor] = {}
        todo: dict[str, MediaItem] = {}
        for m in items:
            if m.hash in out or m.hash in todo:
                continue
            hit = self._entries.get(m.hash)
            if hit is not None:
                self._entries.move_to_end(m.hash)
                self.num_hits += 1
                out[m.hash] = hit
            else:
                todo[m.hash] = m
        if todo:
            pixels = torch.from_numpy(np.concatenate([m.pixels for m in todo.values()]))
            embs = model.encode_images(pixels.to(device), [m.grid for m in todo.values()])
            for m, e in zip(todo.values(), embs):
                if e.shape[0] != m.num_tokens:
                    raise ValueError(f"image {m.hash}: the encoder gives {e.shape[0]} "
                                     f"embeddings for {m.num_tokens} placeholders")
                out[m.hash] = e
                self._put(m.hash, e)
            self.num_encoded += len(todo)
        return out

    def _put(self, h: str, e: torch.Tensor) -> None:
        size = e.numel() * e.element_size()
        if size > self.capacity:
            return
        self._entries[h] = e
        self.bytes += size
        while self.bytes > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()


def embed_with_media(model: torch.nn.Module, ids: torch.Tensor,
                     seqs: Sequence[ScheduledSequence], starts: Sequence[int],
                     cache: EncoderCache) -> torch.Tensor:
    """Token embeddings [T, H] of a step's packed ids, with each image's rows (the part of its
    placeholder run the chunk covers) in place of its placeholders' embeddings."""
    x = model.model.embed_tokens(ids)
    embs = cache.get([m for s in seqs for m in s.media], model, ids.device)
    for s, row in zip(seqs, starts):
        end = s.context_len + len(s.token_ids)
        for m in s.media:
            lo, hi = max(m.offset, s.context_len), min(m.end, end)
            if lo < hi:
                dst = row + lo - s.context_len
                x[dst:dst + hi - lo] = embs[m.hash][lo - m.offset:hi - m.offset].to(x.dtype)
    return x
