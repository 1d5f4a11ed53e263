"""The held-out acceptance a draft's training reports (kdaserve/train/draft.py), on logits
whose answer is known: a perfect draft accepts every position of a block, a miss ends the
block's greedy run, and the sampled estimate is Σ_j Π_{i≤j} Σ min(p_i, q_i)."""

from __future__ import annotations

import math

import pytest
import torch

from kdaserve.train.draft import BlockLogits, block_acceptance

B, A, K, V = 2, 3, 4, 7          # batch, anchors, block, vocabulary


def _one_hot_logits(tokens: torch.Tensor, scale: float = 10.0) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, V).float() * scale


def test_a_perfect_draft_accepts_every_position():
    target = torch.randn(B, A * K, V, generator=torch.Generator().manual_seed(0))
    acc = block_acceptance(BlockLogits(target.clone(), target, K), temperature=0.8)
    assert acc["mean_accepted"] == K and acc["acceptance_rate"] == 1.0
    assert acc["sampled_mean_accepted"] == pytest.approx(K)
    assert acc["sampled_first_draft"] == pytest.approx(1.0)


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_a_miss_ends_the_block(temperature):
    tokens = torch.randint(0, V, (B, A * K), generator=torch.Generator().manual_seed(1))
    drafted = tokens.clone().view(B, A, K)
    drafted[..., 2] = (drafted[..., 2] + 1) % V          # every block misses its third token
    acc = block_acceptance(BlockLogits(_one_hot_logits(drafted.view(B, -1)),
                                       _one_hot_logits(tokens), K), temperature)
    assert acc["mean_accepted"] == 2 and acc["acceptance_rate"] == 2 / K
    # at the miss p and q put e^(10/T) / Z on different tokens and 1/Z on the rest:
    # Σ min(p, q) = V / Z; the positions after it are agreed (α = 1)
    alpha = V / (math.exp(10 / temperature) + V - 1)
    assert acc["sampled_mean_accepted"] == pytest.approx(2 + 2 * alpha)
    assert acc["sampled_acceptance_rate"] == pytest.approx((2 + 2 * alpha) / K)
    assert acc["sampled_first_draft"] == pytest.approx(1.0)
