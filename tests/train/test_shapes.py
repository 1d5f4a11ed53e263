"""The synthetic shapes task: deterministic per seed, images within the issue's spec (sides
64-256 px, one filled shape of the named colour on white, at least a quarter of the shorter
side), and parse_answer reads back every answer."""

from __future__ import annotations

import numpy as np
import pytest

from kdaserve.train.shapes import (COLORS, HELD_OUT_SEED, QUESTIONS, SHAPES, draw,
                                   parse_answer)

SEEDS = list(range(60)) + list(range(HELD_OUT_SEED, HELD_OUT_SEED + 60))


def test_same_seed_same_sample():
    for seed in (0, 7, HELD_OUT_SEED + 3):
        a, b = draw(seed), draw(seed)
        assert (a.color, a.shape, a.question) == (b.color, b.shape, b.question)
        assert a.image.size == b.image.size
        assert a.image.tobytes() == b.image.tobytes()
    images = {draw(s).image.tobytes() for s in range(20)}
    assert len(images) == 20          # different seeds draw different images


@pytest.mark.parametrize("seed", SEEDS)
def test_sample_within_spec(seed):
    s = draw(seed)
    assert s.image.mode == "RGB"
    w, h = s.image.size
    assert 64 <= w <= 256 and 64 <= h <= 256
    assert s.color in COLORS and s.shape in SHAPES and s.question in QUESTIONS
    px = np.asarray(s.image).astype(int)
    white = (px == 255).all(axis=-1)
    assert white.any()
    ys, xs = np.nonzero(~white)
    # the shape's bounding box: at least a quarter of the shorter side, inside the image
    assert xs.max() - xs.min() + 1 >= min(w, h) / 4
    assert ys.max() - ys.min() + 1 >= min(w, h) / 4
    # one fill colour (edges are not anti-aliased), close to the named colour, and
    # nearer to it than to any other colour of the task
    colours = np.unique(px[~white], axis=0)
    assert len(colours) == 1
    fill = colours[0]
    dist = {name: np.abs(fill - np.array(rgb)).max() for name, rgb in COLORS.items()}
    assert dist[s.color] <= 15
    assert min(dist, key=dist.get) == s.color


def test_all_colours_and_shapes_drawn():
    seen = {(draw(s).color, draw(s).shape) for s in range(300)}
    assert seen == {(c, sh) for c in COLORS for sh in SHAPES}


def test_shape_geometry():
    """Fill ratio of the bounding box tells the shapes apart: the drawn shape is the named one."""
    ratios = {"square": (0.97, 1.0), "circle": (0.70, 0.86), "triangle": (0.40, 0.62)}
    for seed in range(90):
        s = draw(seed)
        px = np.asarray(s.image).astype(int)
        ys, xs = np.nonzero(~(px == 255).all(axis=-1))
        box = (xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)
        lo, hi = ratios[s.shape]
        assert lo <= len(xs) / box <= hi, (seed, s.shape, len(xs) / box)


def test_parse_answer_round_trip():
    for c in COLORS:
        for sh in SHAPES:
            s_answer = f"a {c} {sh}"
            assert parse_answer(s_answer) == (c, sh)
            assert parse_answer(f"It is A {c.upper()} {sh}.") == (c, sh)
            assert parse_answer(f"{sh}, {c}") == (c, sh)
    assert draw(5).answer == f"a {draw(5).color} {draw(5).shape}"
    assert parse_answer(draw(5).answer) == (draw(5).color, draw(5).shape)
    assert parse_answer("a purple hexagon") == (None, None)
    assert parse_answer("") == (None, None)
