"""Token bitmasks: one bit per vocabulary id (bit i of int32 word i // 32), 1 = allowed.

Applying a mask costs one pass over V per row: the disallowed bits are unpacked to uint8 [S, V]
with numpy's unpackbits (faster on CPU than shift-and-mask in torch), and DISALLOWED times each
bit is added to the logits. An add has no branch, where masked_fill's per-element choice costs
2-5x more on CPU (4.5 ms against 11-25 ms for 32 rows of 163,840, one thread). A large finite
penalty rather than -inf: a row with nothing allowed (a matcher in error) still samples
without NaNs, and exp() of it is exactly 0 so sampling never picks a disallowed token.

Legend: S rows, V vocabulary, W = ceil(V / 32) words.
"""

from __future__ import annotations

import numpy as np
import torch


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, W] int32, all allowed (a row nobody fills constrains nothing)."""
    return torch.full((rows, words(vocab_size)), -1, dtype=torch.int32)


DISALLOWED = -1e30


def disallowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [S, W] int32 -> uint8 [S, V], 1 where the token is not allowed."""
    inv = np.invert(bitmask.numpy()).view(np.uint8)          # [S, 4W]; little-endian words
    bits = np.unpackbits(inv, axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits)


def apply_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] float32: DISALLOWED added where the mask disallows (in place)."""
    bits = disallowed(bitmask, logits.shape[-1]).to(logits.dtype)
    return logits.add_(bits, alpha=DISALLOWED)


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The allowed ids of one row (for tests and debugging)."""
    return (disallowed(bitmask_row.reshape(1, -1), vocab_size)[0] == 0).nonzero().flatten().tolist()
