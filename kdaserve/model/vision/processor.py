"""Image preprocessing of the Kimi vision path, as transformers' Kimi_K25ImageProcessor does it:
RGB (alpha composited over white), downscale (bicubic, never up) so that the patch grid fits
`max_patches` in all and `max_side` patches per side (the reference's `size.max_height`, in
patches despite its name), pad bottom/right with black to a multiple of patch·merge, scale to
[0, 1], normalise with mean = std
= 0.5, cut into patches in raster order. The result is plain numpy (no torch), so the server's
tokenizer process can prepare images and the engine process receives bytes.

The reference resizes with torchvision's antialiased bicubic on uint8 tensors; Pillow's bicubic
is the filter torchvision's antialias mode follows, so a downscaled image may differ by a grey
level at some pixels. Images that need no downscaling are bit-identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import xxhash
from PIL import Image


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 14
    merge: int = 2
    max_patches: int = 16384
    max_side: int = 512                   # patches per side (the reference's size.max_height)


@dataclass(frozen=True)
class ProcessedImage:
    """pixels: float32 [gh·gw, 3, p, p]; grid (gh, gw) in patches; num_tokens after merging;
    content_hash: of the decoded pixels and grid (not of the file bytes), the cache key."""

    pixels: np.ndarray
    grid: tuple[int, int]
    num_tokens: int
    content_hash: str


def navit_size(h: int, w: int, cfg: ImageProcessorConfig) -> tuple[tuple[int, int],
                                                                    tuple[int, int]]:
    """(resized h, w), (padded h, w) of an image of h x w pixels."""
    p = cfg.patch_size
    side_patches = cfg.max_side
    ph, pw = max(1.0, h // p), max(1.0, w // p)
    scale = min(1.0, math.sqrt(cfg.max_patches / (ph * pw)), side_patches * p / h,
                side_patches * p / w)
    nh, nw = max(1, int(h * scale)), max(1, int(w * scale))
    nh, nw = min(nh, side_patches * p), min(nw, side_patches * p)
    f = cfg.merge * p
    return (nh, nw), (-(-nh // f) * f, -(-nw // f) * f)


def num_image_tokens(h: int, w: int, cfg: ImageProcessorConfig = ImageProcessorConfig()) -> int:
    _, (ph, pw) = navit_size(h, w, cfg)
    return (ph // cfg.patch_size) * (pw // cfg.patch_size) // cfg.merge ** 2


def to_rgb(img: Image.Image) -> Image.Image:
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def preprocess(img: Image.Image, cfg: ImageProcessorConfig = ImageProcessorConfig()
               ) -> ProcessedImage:
    img = to_rgb(img)
    w, h = img.size
    (nh, nw), (ph, pw) = navit_size(h, w, cfg)
    if (nh, nw) != (h, w):
        img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    arr = np.zeros((ph, pw, 3), dtype=np.uint8)
    arr[:nh, :nw] = np.asarray(img, dtype=np.uint8)
    x = (arr.astype(np.float32) / 255.0 - 0.5) / 0.5                  # [ph, pw, 3]
    p = cfg.patch_size
    gh, gw = ph // p, pw // p
    patches = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    digest = xxhash.xxh3_128()
    digest.update(np.asarray([gh, gw, nh, nw], dtype=np.int64).tobytes())
    digest.update(arr.tobytes())
    return ProcessedImage(np.ascontiguousarray(patches), (gh, gw), gh * gw // cfg.merge ** 2,
                          digest.hexdigest())
