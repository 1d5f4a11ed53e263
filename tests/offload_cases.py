"""Shared by the offload tests (one process, and tensor-parallel ranks): prompts that come
back long after the device pool dropped them, run one at a time."""

from __future__ import annotations

import torch

from kdaserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# a device pool of 16 blocks of 4 tokens and four snapshots: each prompt evicts the last one
SMALL = dict(block_size=4, num_blocks=16, state_snapshot_interval=8)


def rounds(vocab: int) -> list[list[list[int]]]:
    """Two rounds over three 30-token roots with fresh suffixes: round 2 hits what round 1
    computed, long after the device pool dropped it."""
    g = torch.Generator().manual_seed(7)
    roots = [torch.randint(3, vocab, (30,), generator=g).tolist() for _ in range(3)]
    return [[r + torch.randint(3, vocab, (3,), generator=g).tolist() for r in roots]
            for _ in range(2)]


def generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """One prompt at a time (each evicts the previous); (tokens, cached tokens) per prompt."""
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0] for p in prompts]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]
