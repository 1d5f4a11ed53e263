"""The incremental stop-string matcher against a brute-force search, text fed in random pieces."""

from __future__ import annotations

import random

import pytest

from kdaserve.stop_matcher import StopMatcher


def brute_first_end(stops, text):
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), -len(s), s)
            best = key if best is None or key < best else best
    return None if best is None else (best[0], best[2])


def brute_pending(stops, text):
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(600):
        stops = list({"".join(rng.choice("abcé") for _ in range(rng.randint(1, 6)))
                      for _ in range(rng.randint(1, 8))})
        text = "".join(rng.choice("abcdé") for _ in range(rng.randint(0, 40)))
        m, pos, got = StopMatcher(stops), 0, None
        while pos < len(text):
            piece = text[pos:pos + rng.randint(1, 6)]
            r = m.feed(piece)
            if r is not None:
                got = (pos + r[0], r[1])
                break
            pos += len(piece)
        assert got == brute_first_end(stops, text)
        if got is None:
            assert m.pending == brute_pending(stops, text)


def test_many_stops_one_pass():
    stops = [f"stop-{i:05d}" for i in range(10_000)]
    m = StopMatcher(stops)
    assert m.feed("xx stop-0999 stop-09999!") == (len("xx stop-0999 stop-09999"), "stop-09999")


def test_empty_stop_refused():
    with pytest.raises(ValueError):
        StopMatcher(["a", ""])
