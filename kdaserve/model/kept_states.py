"""The KDA states a verifying forward kept after each position, whichever forward ran.

Speculative decoding settles after sampling: a verify row's slot gets the state (and conv
window) after its last accepted token, and snapshots planned inside the row are taken from the
states after their positions if those were accepted. Both forwards keep them, in different
layouts: the torch forward per decode row and position (`LayerOutputs`), the fused CPU decoder
one row per token (`fused_rows.Kept`). Each wraps its layout behind `copy_to`, so the executor
of cache operations settles one way (kdaserve/engine/cache_ops.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kdaserve.model.batch import ForwardBatch
from kdaserve.model.fused_rows import Kept


class KeptStates(Protocol):
    def copy_to(self, rows: torch.Tensor, upto: torch.Tensor, states: list[torch.Tensor],
                convs: list[torch.Tensor], dest: torch.Tensor) -> None:
        """The state and window after token `upto` of batch row `rows` (every KDA layer) into
        `dest` of `states` / `convs` (live slots or snapshots)."""


class ForwardKept:
    """The torch forward's: [Bd, Ld] states and [Bd*Ld] windows per KDA layer."""

    def __init__(self, fb: ForwardBatch) -> None:
        self.fb = fb

    def copy_to(self, rows: torch.Tensor, upto: torch.Tensor, states: list[torch.Tensor],
                convs: list[torch.Tensor], dest: torch.Tensor) -> None:
        out, dec = self.fb.out, self.fb.decode
        assert dec is not None, "only multi-token decode rows keep their states"
        ld = dec.pad_src.shape[1]
        for i, (st, cv) in enumerate(zip(states, convs)):
            st.index_copy_(0, dest, out.decode_states[i][rows, upto].to(st.dtype))
            cv.index_copy_(0, dest, out.decode_windows[i][rows * ld + upto].to(cv.dtype))


class FusedKept:
    """The fused decoder's: one row per token, token j of batch row b at starts[b] + j."""

    def __init__(self, kept: Kept, starts: list[int]) -> None:
        self.kept = kept
        self.starts = starts

    def copy_to(self, rows: torch.Tensor, upto: torch.Tensor, states: list[torch.Tensor],
                convs: list[torch.Tensor], dest: torch.Tensor) -> None:
        at = torch.tensor(self.starts, device=rows.device)[rows] + upto
        self.kept.copy_to(at, states, convs, dest)
