"""A request's images, decoded only when they are worth it and never at others' expense.

Every image is opened to its header first (bytes fetched or base64-decoded, the format
parsed; no pixels). From the headers alone the request is checked against the per-image and
per-request pixel limits and, through the vision processor's token count, against
max_model_len, so an image that would be refused costs its header and nothing more. The
decoding itself runs in a pool of its own (the tokenizer's pool keeps serving text requests)
under a memory budget: an image waits until the pixels already being decoded leave room for
its own. The whole is awaited under the client's connection: a disconnect cancels what has not
started (a decode already running finishes; there is no safe way to stop PIL mid-image).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

from PIL import Image

from kdaserve.background_pool import background_pool
from kdaserve.image_io import (
    ImageError,
    ImageLimits,
    decoded_bytes,
    finish_decode,
    open_image,
)

DEFAULT_WORKERS = 2
DEFAULT_MEMORY_BUDGET = 1 << 30         # bytes of pixels being decoded at once, all requests


class ImageDecoder:
    def __init__(self, limits: ImageLimits, workers: int = DEFAULT_WORKERS,
                 memory_budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.limits = limits
        self.memory_budget = memory_budget
        self._pool = background_pool(workers, "kdaserve-image")
        self._held = 0
        self._room: asyncio.Condition | None = None       # made on the event loop

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args))

    async def load(self, refs: Sequence[tuple[int, int, Any]],
                   tokens_of: Callable[[int, int], int] | None, room_tokens: int
                   ) -> list[Image.Image]:
        """refs: (message, part, image_url) of each image. tokens_of(h, w): the prompt tokens
        an image becomes; room_tokens: what max_model_len leaves them. ImageError names the
        image and the limit."""
        opened = []
        for i, j, url in refs:
            try:
                opened.append(await self._run(open_image, url, self.limits))
            except ImageError as exc:
                raise ImageError(f"messages[{i}].content[{j}]: {exc}") from None
        pixels = sum(img.size[0] * img.size[1] for img in opened)
        if pixels > self.limits.max_request_pixels:
            raise ImageError(f"the request's images have {pixels} pixels together; the limit "
                             f"is {self.limits.max_request_pixels} per request")
        if tokens_of is not None:
            tokens = sum(tokens_of(img.size[1], img.size[0]) for img in opened)
            if tokens > room_tokens:
                raise ImageError(f"the images become {tokens} prompt tokens, more than the "
                                 f"{room_tokens} that max_model_len leaves them")
        for (i, j, _), img in zip(refs, opened):
            try:
                await self._decode(img)
            except ImageError as exc:
                raise ImageError(f"messages[{i}].content[{j}]: {exc}") from None
        return opened

    async def _decode(self, img: Image.Image) -> None:
        need = decoded_bytes(img)
        if need > self.memory_budget:
            raise ImageError(f"decoding the image needs {need} bytes, over the server's "
                             f"image memory budget of {self.memory_budget}")
        if self._room is None:
            self._room = asyncio.Condition()
        async with self._room:
            await self._room.wait_for(lambda: self._held + need <= self.memory_budget)
            self._held += need
        try:
            await self._run(finish_decode, img)
        finally:
            async with self._room:
                self._held -= need
                self._room.notify_all()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
