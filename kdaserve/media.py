"""Images inside a token sequence: where each one sits and what identifies it.

An image becomes a run of `num_tokens` placeholder tokens in the prompt, starting at `offset`;
the runner replaces their embeddings with the image's (encoded once, cached by `hash`). The
prefix cache hashes each image at its position (`placed_key`), so blocks before an image are
shared by prompts that differ only in it, and blocks from it on are not. Plain Python + numpy:
the scheduler, the cache manager and the server's tokenizer side use it without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from kdaserve.cache.prefix_cache import PlacedKey


@dataclass(frozen=True, eq=False)
class MediaItem:
    """One image of a request: pixels float32 [gh·gw, 3, p, p] in patches, grid (gh, gw)."""

    hash: str
    offset: int
    num_tokens: int
    grid: tuple[int, int]
    pixels: np.ndarray

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def placed_key(self) -> PlacedKey:
        return PlacedKey(f"image:{self.hash}", self.offset, self.end)

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


class MediaWire(msgspec.Struct, array_like=True):
    """MediaItem on the server -> engine wire (raw float32 bytes, never pickle)."""

    hash: str
    offset: int
    num_tokens: int
    grid_h: int
    grid_w: int
    patch: int
    pixels: bytes

    @classmethod
    def of(cls, m: MediaItem) -> MediaWire:
        return cls(m.hash, m.offset, m.num_tokens, m.grid[0], m.grid[1], m.pixels.shape[-1],
                   np.ascontiguousarray(m.pixels, dtype=np.float32).tobytes())

    def item(self) -> MediaItem:
        n, p = self.grid_h * self.grid_w, self.patch
        if p <= 0 or len(self.pixels) != n * 3 * p * p * 4:
            raise ValueError(f"image {self.hash}: {len(self.pixels)} pixel bytes do not match "
                             f"its {self.grid_h}x{self.grid_w} grid of {p}-pixel patches")
        pixels = np.frombuffer(self.pixels, dtype=np.float32).reshape(n, 3, p, p)
        return MediaItem(self.hash, self.offset, self.num_tokens, (self.grid_h, self.grid_w),
                         pixels)


def expand_placeholders(ids: Sequence[int], placeholder: int, images: Sequence,
                        ) -> tuple[list[int], list[MediaItem]]:
    """Each occurrence of `placeholder` in ids (one per image, in order) becomes a run of that
    image's num_tokens placeholders. images: ProcessedImage-like (pixels, grid, num_tokens,
    content_hash)."""
    at = [i for i, t in enumerate(ids) if t == placeholder]
    if len(at) != len(images):
        raise ValueError(f"the prompt has {len(at)} image placeholder(s) for {len(images)} "
                         "image(s)")
    out: list[int] = []
    items: list[MediaItem] = []
    prev = 0
    for pos, img in zip(at, images):
        out.extend(ids[prev:pos])
        items.append(MediaItem(img.content_hash, len(out), img.num_tokens, tuple(img.grid),
                               img.pixels))
        out.extend([placeholder] * img.num_tokens)
        prev = pos + 1
    out.extend(ids[prev:])
    return out, items


def check_media(items: Sequence[MediaItem], prompt: Sequence[int], placeholder: int | None,
                merge: int) -> None:
    """An engine-side check of what a client sent: in the prompt, in order, not overlapping,
    over placeholder tokens, as many tokens as the grid gives."""
    prev_end = 0
    for m in items:
        gh, gw = m.grid
        if m.num_tokens <= 0 or gh * gw != m.num_tokens * merge:
            raise ValueError(f"image {m.hash}: {m.num_tokens} tokens do not match its "
                             f"{gh}x{gw} patch grid")
        if m.offset < prev_end or m.end > len(prompt):
            raise ValueError(f"image {m.hash}: placeholder run [{m.offset}, {m.end}) overlaps "
                             "another image or lies outside the prompt")
        if placeholder is not None and any(t != placeholder for t in prompt[m.offset:m.end]):
            raise ValueError(f"image {m.hash}: the prompt has other tokens than the media "
                             f"placeholder ({placeholder}) at [{m.offset}, {m.end})")
        prev_end = m.end
