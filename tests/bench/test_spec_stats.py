"""The paired bootstrap interval of block against token acceptance, and the repeat-by-repeat
interval of speculative against plain speed (bench/spec_stats.py)."""

from __future__ import annotations

import math

import pytest

from kdaserve.bench.spec_stats import acceptance_length, paired_ratio_ci, paired_speed_ci


def test_acceptance_length_pools_the_requests():
    # 3 + 1 accepted over 2 + 2 blocks: (4 + 4) / 4 tokens a block, not the mean of 2.5 and 1.5
    assert acceptance_length([(3, 2), (1, 2)]) == 2.0
    assert acceptance_length([(0, 0)]) == 1.0


def test_same_counts_on_both_sides_give_a_point_at_one():
    blocks = [(5, 3), (2, 4), (9, 2), (0, 1)]
    assert paired_ratio_ci(blocks, blocks) == (1.0, 1.0)


def test_the_interval_holds_the_pooled_ratio_and_narrows_with_more_requests():
    token = [(4 + i % 3, 4) for i in range(8)]
    block = [(6 + (i * 5) % 4, 4) for i in range(8)]
    point = acceptance_length(block) / acceptance_length(token)
    lo, hi = paired_ratio_ci(token, block)
    assert lo < point < hi and lo > 1.0          # block ahead on every request
    lo4, hi4 = paired_ratio_ci(token * 4, block * 4)
    assert lo <= lo4 < point < hi4 <= hi and hi4 - lo4 < 0.75 * (hi - lo)
    assert paired_ratio_ci(token, block) == (lo, hi)     # a fixed seed: the same interval


def test_pairs_are_kept_together():
    # every request's block length is twice its token length (one block each), whatever the
    # request's own level: resampled in pairs every ratio is exactly 2; drawn apart, not
    token = [(1, 1), (3, 1), (5, 1), (9, 1)]
    block = [(2 * a + 1, v) for a, v in token]
    assert paired_ratio_ci(token, block) == (2.0, 2.0)


def test_mismatched_sides_are_refused():
    with pytest.raises(ValueError):
        paired_ratio_ci([(1, 1)], [(1, 1), (2, 1)])
    with pytest.raises(ValueError):
        paired_ratio_ci([], [])


def test_speed_pairs_give_the_geometric_mean_and_a_t_interval():
    # tokens a second: spec / plain = 1.1, 0.9, 1.0 on three repeats (times and tokens differ)
    base = [(2.0, 100), (1.0, 100), (4.0, 200)]
    spec = [(1.0, 55), (1.0, 90), (2.0, 100)]
    mean, lo, hi = paired_speed_ci(base, spec)
    logs = [math.log(1.1), math.log(0.9), 0.0]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    assert mean == round(math.exp(m), 3)
    assert (lo, hi) == (round(math.exp(m - 4.303 * sd / math.sqrt(3)), 3),
                        round(math.exp(m + 4.303 * sd / math.sqrt(3)), 3))
    assert lo < 0.97 < 1.03 < hi       # three scattered pairs show nothing either way


def test_speed_interval_narrows_with_repeats_and_sits_on_a_constant_ratio():
    base = [(1.0 + 0.1 * (i % 3), 100) for i in range(12)]
    spec = [(t / 1.02, n) for t, n in base]           # 2% faster in every pair
    assert paired_speed_ci(base, spec) == (1.02, 1.02, 1.02)
    noisy = [(t * (1.0 + 0.03 * (-1) ** i), n) for i, (t, n) in enumerate(spec)]
    _, lo3, hi3 = paired_speed_ci(base[:4], noisy[:4])
    _, lo12, hi12 = paired_speed_ci(base, noisy)
    assert lo3 < lo12 < 1.02 < hi12 < hi3
    _, lo40, hi40 = paired_speed_ci(base * 4 + base[:-8], noisy * 4 + noisy[:-8])  # 40: t ~ 2
    assert lo12 < lo40 < 1.02 < hi40 < hi12


def test_speed_pairs_are_checked():
    assert paired_speed_ci([(1.0, 10)], [(0.5, 10)]) == (2.0, None, None)
    with pytest.raises(ValueError):
        paired_speed_ci([(1.0, 10)], [])
