"""The packed token rows of a step, shared by every layout builder.

Sequences are packed back to back into T rows, decode rows (the first `num_decode`
sequences) first. Legend: T tokens (Td of them in decode rows), B sequences, K conv kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.long, device=device)


@dataclass(frozen=True)
class PackedRows:
    """Where each sequence's tokens sit in the flat [T] batch and at which positions."""

    lens: torch.Tensor          # [B] tokens of each sequence in this step
    ctx: torch.Tensor           # [B] tokens already in the cache before them
    cu: torch.Tensor            # [B+1] offsets of the sequences in the flat batch
    seq_of: torch.Tensor        # [T] the sequence of each token
    local: torch.Tensor         # [T] the token's index inside its sequence's share
    positions: torch.Tensor     # [T] absolute positions (ctx + local)
    num_decode: int
    num_tokens: int             # T
    num_decode_tokens: int      # Td

    @classmethod
    def build(cls, seq_lens: list[int], context_lens: list[int], num_decode: int,
              device: torch.device, positions: torch.Tensor | None = None) -> PackedRows:
        """`positions`: the step's [T] positions when the caller holds them already (a decode
        step's persistent inputs); the same values as computed here."""
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
        ctx = torch.tensor(context_lens, dtype=torch.long, device=device)
        B = len(seq_lens)
        cu = torch.zeros(B + 1, dtype=torch.long, device=device)
        cu[1:] = lens.cumsum(0)
        # sizes from the Python lists: reading the tensors back would wait for the device
        T = sum(seq_lens)
        Td = sum(seq_lens[:num_decode])
        seq_of = torch.repeat_interleave(arange(B, device), lens, output_size=T)   # [T]
        local = arange(T, device) - cu[seq_of]                            # [T]
        if positions is None:
            positions = ctx[seq_of] + local
        return cls(lens, ctx, cu, seq_of, local, positions, num_decode, T, Td)

    @property
    def num_seqs(self) -> int:
        return int(self.lens.shape[0])

    @property
    def device(self) -> torch.device:
        return self.lens.device


@dataclass(frozen=True)
class ConvRows:
    """Row numbers in a KDA layer's conv input `ext` = cat(the sequences' carried windows
    [B*(K-1)], the step's tokens [T], one zero row): the layers build `ext`, the builders
    say which of its rows each conv position reads."""

    num_seqs: int
    km1: int                    # K-1: inputs a window carries
    num_tokens: int

    def window(self, seq: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Entry j (0 oldest .. K-2) of sequence `seq`'s carried window."""
        return seq * self.km1 + j

    def token(self, t: torch.Tensor) -> torch.Tensor:
        """Flat token row t of the step."""
        return self.num_seqs * self.km1 + t

    @property
    def zero(self) -> int:
        """The zero row: what padding reads."""
        return self.num_seqs * self.km1 + self.num_tokens

    def before(self, seq: torch.Tensor, start: torch.Tensor, upto: torch.Tensor
               ) -> torch.Tensor:
        """[N, K-1]: the K-1 inputs before local position `upto` of sequence `seq` (whose
        tokens start at flat row `start`): the conv window once `upto` tokens are in. Reaches
        back into the carried window when `upto` < K-1."""
        offs = upto[:, None] - self.km1 + arange(self.km1, seq.device)[None]
        return torch.where(offs >= 0, self.token(start[:, None] + offs),
                           self.window(seq[:, None], self.km1 + offs))
