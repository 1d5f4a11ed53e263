"""The synthetic visual task of the vision demo: one filled shape (circle, square or triangle)
in one colour (red, green, blue or yellow) on white, image sides 64-256 px, the shape anywhere
and at least a quarter of the shorter side; the answer names colour and shape ("a red
circle"). Deterministic per seed: training and held-out sets are disjoint seed ranges."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 70, 220),
          "yellow": (240, 205, 20)}
QUESTIONS = (
    "What is in the image?", "What do you see?", "Describe the image.",
    "What shape is this, and what colour?", "Which shape and color are shown?",
    "What is this picture of?", "Tell me what the image shows.", "What is drawn here?",
    "Name the shape in the picture.", "What can you see in this image?",
    "What colour is the shape?", "Can you describe this picture?",
)
HELD_OUT_SEED = 1_000_000        # held-out images and questions draw seeds from here on


@dataclass(frozen=True)
class Sample:
    image: Image.Image
    color: str
    shape: str
    question: str

    @property
    def answer(self) -> str:
        return f"a {self.color} {self.shape}"


def draw(seed: int) -> Sample:
    rng = random.Random(seed)
    w, h = rng.randint(64, 256), rng.randint(64, 256)
    color, shape = rng.choice(sorted(COLORS)), rng.choice(SHAPES)
    jitter = [max(0, min(255, c + rng.randint(-15, 15))) for c in COLORS[color]]
    img = Image.new("RGB", (w, h), (255, 255, 255))
    side = min(w, h)
    size = rng.randint(math.ceil(side / 4), int(side * 0.9))
    x0, y0 = rng.randint(0, w - size), rng.randint(0, h - size)
    d = ImageDraw.Draw(img)
    box = (x0, y0, x0 + size - 1, y0 + size - 1)
    if shape == "circle":
        d.ellipse(box, fill=tuple(jitter))
    elif shape == "square":
        d.rectangle(box, fill=tuple(jitter))
    else:
        d.polygon([(x0 + size / 2, y0), (x0, y0 + size - 1), (x0 + size - 1, y0 + size - 1)],
                  fill=tuple(jitter))
    return Sample(img, color, shape, rng.choice(QUESTIONS))


def parse_answer(text: str) -> tuple[str | None, str | None]:
    """(colour, shape) named in a reply (first of each), for scoring."""
    words = text.lower().replace(".", " ").replace(",", " ").split()
    color = next((w for w in words if w in COLORS), None)
    shape = next((w for w in words if w in SHAPES), None)
    return color, shape
