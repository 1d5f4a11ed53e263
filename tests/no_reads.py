"""The sync detector: while inside `no_reads()`, every way Python reads a tensor's value back
(item, tolist, int(), bool(), index) raises, so a code path that must stay on the device
(a decode step, the MoE kernels' launch, device sampling) is checked on CPU tensors."""

from __future__ import annotations

import contextlib

import torch

READS = ("item", "tolist", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def no_reads():
    """Every way Python reads a tensor's value raises while inside."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def refuse(name):
        def method(self, *a, **k):
            raise AssertionError(f"Tensor.{name} read a tensor back during a decode step")
        return method

    try:
        for name in READS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, m in saved.items():
            setattr(torch.Tensor, name, m)
