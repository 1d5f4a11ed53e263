"""The accelerator table `kdaserve plan` reads: kdaserve/plan/hardware.json, or a user's file
with the same keys (--hardware FILE adds to it or overrides entries)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TABLE = Path(__file__).with_name("hardware.json")


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float
    memory_bw: float
    bf16_flops: float
    fp8_flops: float | None
    fp4_flops: float | None
    link_bw: float
    link_latency_s: float
    node_gpus: int
    net_bw: float
    net_latency_s: float
    price_per_hour: float
    purchase_price: float

    def flops(self, kind: str) -> float:
        """Tensor FLOP/s for weights of this kind (falls back to the next wider type)."""
        for k in {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16")}.get(kind, ("bf16",)):
            v = getattr(self, f"{k}_flops")
            if v:
                return v
        return self.bf16_flops


def load_table(extra: str | None = None) -> dict[str, Hardware]:
    raw = json.loads(TABLE.read_text(encoding="utf-8"))
    if extra:
        raw.update(json.loads(Path(extra).read_text(encoding="utf-8")))
    return {name: Hardware(name, **{k: v for k, v in spec.items()})
            for name, spec in raw.items() if not name.startswith("_")}


def find(table: dict[str, Hardware], name: str) -> Hardware:
    key = {k.lower().replace(" ", "").replace("-", ""): k for k in table}
    want = name.lower().replace(" ", "").replace("-", "")
    if want not in key:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(table))} "
                         "(add entries with --hardware FILE)")
    return table[key[want]]
