"""Images over the OpenAI API (real server process, openai client): image_url parts with data
URLs, and every kind of bad image refused with a 400 that names the limit, the server serving
on after each."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from server_harness import corpus, start_server
from vision_models import build_tiny_vision_model


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    model = build_tiny_vision_model(tmp_path_factory.mktemp("tiny_vision"), corpus())
    log = tmp_path_factory.mktemp("logs") / "vision.log"
    srv = start_server(model, log, "--max-model-len", "512", "--cache-memory", "64MiB",
                       "--torch-threads", "1", "--max-images-per-request", "2",
                       "--max-image-pixels", "1000000",
                       "--served-model-name", "kdaserve")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(vision_server):
    return openai.OpenAI(base_url=vision_server.base_url, api_key="none", max_retries=0)


def png(w=80, h=64, seed=0, fmt="PNG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def bomb_png(w=20000, h=20000) -> bytes:
    """A valid PNG header declaring w x h pixels, with a few bytes of image data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def ask(client, *urls, text="What is in the image?", max_tokens=6):
    content = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return client.chat.completions.create(
        model="kdaserve", messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens, temperature=0)


def test_chat_with_images(client):
    one = ask(client, data_url(png()))
    assert one.choices[0].finish_reason == "length"
    # 64x80 pixels -> a 6x6 patch grid -> 9 image tokens in the prompt
    plain = client.chat.completions.create(
        model="kdaserve", max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": "What is in the image?"}])
    assert one.usage.prompt_tokens >= plain.usage.prompt_tokens + 9
    again = ask(client, data_url(png()))
    assert again.choices[0].message.content == one.choices[0].message.content
    jpeg, webp = ask(client, data_url(png(fmt="JPEG"), "image/jpeg")), \
        ask(client, data_url(png(fmt="WEBP"), "image/webp"))
    assert jpeg.choices[0].message.content is not None and webp.usage.prompt_tokens
    two = ask(client, data_url(png(seed=1)), data_url(png(40, 40, seed=2)))
    assert two.usage.prompt_tokens > one.usage.prompt_tokens


BAD = {
    "truncated": (lambda: data_url(png()[:200]), "truncated"),
    "wrong_base64": (lambda: "data:image/png;base64,@@not*base64@@", "base64"),
    "bomb_header": (lambda: data_url(bomb_png()), "pixels"),
    "over_pixel_limit": (lambda: data_url(png(1200, 1000)), "1000000 pixels"),
    "http_url": (lambda: "http://127.0.0.1:9/cat.png", "http"),
    "not_an_image": (lambda: data_url(b"GIF89a" + b"\x00" * 40, "image/png"), "PNG, JPEG"),
    "other_mime": (lambda: data_url(png(), "image/svg+xml"), "image/svg+xml"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_image_is_a_400_and_the_server_keeps_serving(client, case):
    make, words = BAD[case]
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, make())
    assert err.value.status_code == 400
    assert words in err.value.message
    assert ask(client, data_url(png(seed=3))).choices[0].message.content is not None


def test_too_many_images(client):
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, *[data_url(png(seed=s)) for s in range(3)])
    assert "3 images; at most 2" in err.value.message
    assert ask(client, data_url(png(seed=4))).usage.prompt_tokens


def test_placeholder_text_without_an_image(client):
    """A user typing the media token itself cannot make image rows without an image: the
    typed token is text (issue 35), so the image keeps its 9 rows and nothing else gets any."""
    plain = ask(client, data_url(png()), text="look: ").usage.prompt_tokens
    once = ask(client, data_url(png()), text="look: <|media_pad|>").usage.prompt_tokens
    twice = ask(client, data_url(png()), text="look: <|media_pad|><|media_pad|>").usage
    # each typed token is its characters (encoded alone), the same count every time
    assert once > plain and twice.prompt_tokens - once == once - plain


@pytest.mark.parametrize("size,why", [
    ((1, 999_999), "aspect ratio"),               # issue 35's 1 x 39,999,999 strip, scaled
    ((1000, 1000), "max_model_len"),              # tokens known from the header
])
def test_images_are_judged_from_their_header(client, vision_server, size, why):
    """Refused before a pixel is decoded: the data behind these headers is not an image at
    all, so decoding would have said "corrupt"."""
    with ThreadPoolExecutor(1) as pool:
        probe = pool.submit(ask, client, data_url(bomb_png(*size)))
        assert ask(client, data_url(png(seed=5))).usage.prompt_tokens
        with pytest.raises(openai.BadRequestError) as err:
            probe.result(timeout=120)
    assert why in err.value.message and "corrupt" not in err.value.message
    assert httpx.get(vision_server.url + "/health", timeout=10).status_code == 200


def test_torch_loads_in_the_engine_process_only(vision_server):
    """The HTTP process read the checkpoint's vision config and preprocessed the images above
    without torch (importing it costs each server start seconds of CPU)."""
    def maps(pid: int) -> str:
        return Path(f"/proc/{pid}/maps").read_text()

    assert "libtorch" in maps(vision_server.engine_pid())
    assert "libtorch" not in maps(vision_server.proc.pid)
