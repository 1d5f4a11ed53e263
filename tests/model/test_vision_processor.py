"""Image preprocessing: the reference's geometry (navit resize in patches, pad to the merge
grid), exact values where no resampling happens, content hashes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from kdaserve.model.vision.processor import (
    ImageProcessorConfig,
    navit_size,
    num_image_tokens,
    preprocess,
)


def rand_image(h, w, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)


def test_geometry():
    cfg = ImageProcessorConfig()
    assert navit_size(64, 80, cfg) == ((64, 80), (84, 84))
    assert navit_size(300, 600, cfg) == ((300, 600), (308, 616))   # no resize: <16384 patches
    (h, w), (ph, pw) = navit_size(2000, 2000, cfg)                  # 142² patches > 16384
    assert (h, w) == (1802, 1802) and (ph, pw) == (1820, 1820)
    assert num_image_tokens(64, 80) == 9 and num_image_tokens(2000, 2000) == 65 * 65
    small = ImageProcessorConfig(max_patches=64)
    p = preprocess(rand_image(300, 200), small)
    assert p.grid[0] * p.grid[1] <= 64 + 2 * p.grid[0] + 2 * p.grid[1]   # padding only
    assert p.pixels.shape == (p.grid[0] * p.grid[1], 3, 14, 14)


def test_values_and_hash():
    img = rand_image(30, 40)
    p = preprocess(img)
    arr = np.asarray(img, dtype=np.float32) / 255.0 * 2 - 1
    # patch (0, 0), channel 0, its 14x14 pixels; padding (bottom/right) is black -> -1
    assert np.allclose(p.pixels[0, 0], arr[:14, :14, 0], atol=1e-6)
    last = p.pixels[-1]
    assert np.all(last[:, -1, :] == -1.0)
    assert preprocess(img.copy()).content_hash == p.content_hash
    assert preprocess(rand_image(30, 40, seed=1)).content_hash != p.content_hash
    rgba = img.convert("RGBA")
    rgba.putalpha(0)                              # fully transparent: white, as the reference
    assert np.all(preprocess(rgba).pixels[0] == 1.0)


@pytest.mark.parametrize("size", [(64, 80), (300, 600), (33, 200)])
def test_matches_reference_processor(size):
    """transformers' Kimi_K25ImageProcessor needs torchvision (not installed here)."""
    pytest.importorskip("torchvision")
    import torch
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    img = rand_image(*size)
    ref = Kimi_K25ImageProcessor()(images=[img], return_tensors="pt")
    p = preprocess(img)
    assert tuple(ref["image_grid_thw"][0, 1:].tolist()) == p.grid
    assert torch.allclose(ref["pixel_values"], torch.from_numpy(p.pixels), atol=1e-6)
