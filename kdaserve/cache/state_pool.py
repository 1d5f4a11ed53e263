"""KDA state slot ids (no tensors here): one live slot per running request."""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))   # pop() hands out 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"state slot {slot} freed twice or out of range")
        self._free.append(slot)
