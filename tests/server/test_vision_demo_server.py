"""The bundled demo's vision end to end: `kdaserve serve` with its default model (the tiny K3
demo and its tower, a real server process) and the official openai client; 50 held-out
synthetic images (seeds the
training never drew) sent as PNG data URLs with "What is in the image?"; the reply must name the
shape's colour and shape. Prints the accuracy; the issue's bar is 0.9."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from server_harness import start_server

from kdaserve.assets import default_model_path
from kdaserve.train.shapes import HELD_OUT_SEED, draw, parse_answer

NUM_IMAGES = 50
# Seeds past the ones training_summary.json scores (HELD_OUT_SEED .. +200), so that this
# check is not the one that picked the checkpoint.
FIRST_SEED = HELD_OUT_SEED + 10_000


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "vision_demo.log"
    srv = start_server(default_model_path(), log, "--torch-threads", "1",
                       "--max-model-len", "1024", "--cache-memory", "64MiB", timeout=180.0)
    yield srv
    srv.stop()


def png_data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_the_demo_names_colour_and_shape(demo_server):
    client = openai.OpenAI(base_url=demo_server.base_url, api_key="none", max_retries=0,
                           timeout=60.0)
    right, misses = 0, []
    for seed in range(FIRST_SEED, FIRST_SEED + NUM_IMAGES):
        s = draw(seed)
        reply = client.chat.completions.create(
            model="kdaserve-demo", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is in the image?"},
                {"type": "image_url", "image_url": {"url": png_data_url(s.image)}}]}])
        text = reply.choices[0].message.content or ""
        if parse_answer(text) == (s.color, s.shape):
            right += 1
        else:
            misses.append((seed, s.answer, text))
    accuracy = right / NUM_IMAGES
    print(f"vision demo accuracy over {NUM_IMAGES} held-out images: {accuracy:.2f} "
          f"({right}/{NUM_IMAGES}); misses: {misses[:10]}")
    assert accuracy >= 0.9, misses
