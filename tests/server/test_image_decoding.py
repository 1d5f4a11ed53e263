"""The server's image decoder without a server: per-request pixels and tokens from headers,
the memory budget, and cancellation of what has not started."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from kdaserve.image_io import ImageError, ImageLimits
from kdaserve.server.image_decoding import ImageDecoder


def url(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_request_pixels_tokens_and_memory_are_checked_before_decoding():
    limits = ImageLimits(max_pixels=10_000, max_request_pixels=15_000)
    dec = ImageDecoder(limits, memory_budget=4 * 7_000)
    refs = [(0, 1, url(100, 80)), (1, 0, url(80, 60))]
    with pytest.raises(ImageError, match="12800 pixels together") as e:
        asyncio.run(ImageDecoder(ImageLimits(max_request_pixels=12_000)).load(refs, None, 99))
    assert e.value
    with pytest.raises(ImageError, match="become 25 prompt tokens, more than the 24"):
        asyncio.run(dec.load(refs, lambda h, w: h * w // 500, 24))
    with pytest.raises(ImageError, match=r"messages\[0\].content\[1\]: decoding the image"):
        asyncio.run(dec.load(refs, None, 99))           # 8000 pixels: 32000 bytes, over the budget
    images = asyncio.run(dec.load(refs[1:], lambda h, w: 1, 1))
    assert images[0].size == (80, 60) and images[0].getpixel((0, 0)) == (0, 0, 0)
    assert dec._held == 0
    dec.close()


def test_a_cancelled_load_decodes_nothing_more():
    dec = ImageDecoder(ImageLimits(), workers=1)
    refs = [(0, i, url(64, 64)) for i in range(6)]

    async def cancel_early():
        task = asyncio.ensure_future(dec.load(refs, None, 99))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_early())
    assert dec._held == 0
    dec.close()
