"""Routed experts' checkpoint names <-> the stacked tensors the model keeps
(`...experts.{e}.w1.weight` is rows [0, I) of expert e in `experts_w13`)."""

from __future__ import annotations

import re

import torch

# Routed experts are stored stacked in the model; the checkpoint names them one by one, as
# plain weights or packed (`weight_packed` + `weight_scale`: MXFP4, or INT8/INT4 with an
# optional `weight_zero_point`).
_EXPERT = re.compile(r"^(.*\.block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3)\."
                     r"(weight|weight_packed|weight_scale|weight_zero_point)$")
STACK_SUFFIX = {"weight": "", "weight_packed": "_packed", "weight_scale": "_scale",
                "weight_zero_point": "_zero_point"}


def expert_target(name: str) -> tuple[str, int, str] | None:
    """`...experts.{e}.w1.weight[_packed|_scale]` -> (stacked tensor name, e, part)."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    base = "experts_w2" if m.group(3) == "w2" else "experts_w13"
    return f"{m.group(1)}.{base}{STACK_SUFFIX[m.group(4)]}", int(m.group(2)), m.group(3)


def expert_slice(t: torch.Tensor, e: int, part: str) -> torch.Tensor:
    """The view of stacked tensor `t` that holds expert e's `part`."""
    if part == "w2":
        return t[e]
    half = t.shape[1] // 2
    return t[e, :half] if part == "w1" else t[e, half:]
