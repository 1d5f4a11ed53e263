"""The paired bootstrap interval of block against token acceptance (bench/spec_stats.py)."""

from __future__ import annotations

import pytest

from kdaserve.bench.spec_stats import acceptance_length, paired_ratio_ci


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
