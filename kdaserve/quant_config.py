"""`WeightQuant`: weight-only integer quantization of a model's linears (INT8 or INT4, one
scale per group of consecutive input columns, optional zero points), and its spelling as a
compressed-tensors `quantization_config` (`format: pack-quantized`).

Torch-free: ModelConfig carries it, and the bookkeeping that reads ModelConfig imports no
torch. Which linears it applies to follows compressed-tensors: `targets` name modules by
class (`Linear`), by exact name, or by a `re:` pattern matched at the start of the name;
`ignore` (same forms) wins over `targets`. Names are the checkpoint's (HF) module names:
`model.layers.3.self_attn.q_proj`, `model.layers.1.block_sparse_moe.experts.7.w1`, `lm_head`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kdaserve.config import ConfigError

SCHEMES = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class WeightQuant:
    bits: int                                   # 8 or 4
    group_size: int                             # input columns per scale
    symmetric: bool = True                      # False: a zero point per group too
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"weight quantization: num_bits must be 4 or 8, got {self.bits}")
        if self.group_size <= 0 or self.group_size % 2:
            raise ConfigError(f"weight quantization: group_size must be a positive even number, "
                              f"got {self.group_size}")

    @property
    def scheme(self) -> str:
        return f"int{self.bits}"

    def applies(self, *names: str) -> bool:
        """Whether the linear module `names` (its spellings) is quantized."""
        return (any(_matches(t, n) for t in self.targets for n in names)
                and not any(_matches(t, n) for t in self.ignore for n in names))

    def to_compressed_tensors(self) -> dict[str, Any]:
        """The `quantization_config` of a checkpoint stored this way."""
        return {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": list(self.targets), "format": "pack-quantized",
                "weights": {"num_bits": self.bits, "type": "int", "symmetric": self.symmetric,
                            "strategy": "channel" if self.group_size == CHANNEL else "group",
                            "group_size": None if self.group_size == CHANNEL
                            else self.group_size,
                            "dynamic": False, "observer": "minmax"},
                "input_activations": None, "output_activations": None}},
            "ignore": list(self.ignore),
        }


def _matches(target: str, name: str) -> bool:
    if target == "Linear":
        return True          # every module the loader quantizes is a linear layer
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def from_scheme(scheme: str, group_size: int = 128, lm_head: bool = True) -> WeightQuant:
    """`--quantization int8|int4`: every linear but the embedding (and the head, unless
    lm_head)."""
    if scheme not in SCHEMES:
        raise ConfigError(f"quantization must be one of {sorted(SCHEMES)}, got {scheme!r}")
    # K3's attention-residual projections have one output each: nothing to save there
    ignore = ("re:.*_res_proj$",) + (() if lm_head else ("lm_head",))
    return WeightQuant(SCHEMES[scheme], group_size, ignore=ignore)


def is_pack_quantized(qc: dict[str, Any] | None) -> bool:
    """Whether a quantization_config describes integer pack-quantized weights."""
    if not qc or qc.get("quant_method") != "compressed-tensors":
        return False
    fmts = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()
                                 if isinstance(g, dict)}
    fmts.discard(None)
    return fmts == {"pack-quantized"}


def parse_compressed_tensors(qc: dict[str, Any]) -> WeightQuant:
    """A pack-quantized compressed-tensors config -> WeightQuant (one weight scheme for all
    its groups: what kdaserve's layers store)."""
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    if not groups:
        raise ConfigError("config.json: quantization_config has no config_groups")
    targets: list[str] = []
    schemes = set()
    for g in groups:
        w = g.get("weights") or {}
        if g.get("input_activations") or w.get("type", "int") != "int" or w.get("dynamic"):
            raise ConfigError("config.json: only weight-only static INT quantization is "
                              f"supported, got {g}")
        strategy = w.get("strategy") or ("group" if w.get("group_size") else "channel")
        if strategy not in ("group", "channel"):
            raise ConfigError(f"config.json: quantization strategy {strategy!r} is not "
                              "supported (group, channel)")
        if w.get("actorder") not in (None, False, "weight"):
            raise ConfigError(f"config.json: actorder {w.get('actorder')!r} is not supported")
        group = int(w["group_size"]) if strategy == "group" else 0
        schemes.add((int(w.get("num_bits", 8)), group, bool(w.get("symmetric", True))))
        targets += list(g.get("targets") or [])
    if len(schemes) != 1:
        raise ConfigError(f"config.json: config_groups with different weight schemes "
                          f"{sorted(schemes)} are not supported")
    bits, group, symmetric = schemes.pop()
    # channel strategy: one group spanning the row; the loader sizes it per layer
    return WeightQuant(bits, group or CHANNEL, symmetric, tuple(targets),
                       tuple(qc.get("ignore") or ()))


# a group size no layer reaches: one scale per output row (compressed-tensors' "channel")
CHANNEL = 1 << 30
