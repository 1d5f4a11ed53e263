"""What a CUDA graph capture refuses, caught on CPU: a TorchDispatchMode that raises on every op
which on CUDA would synchronise with the host or copy from host memory while a graph is being
captured (and so fail the capture, or bake one step's values into every replay).

The checks of tests/engine/test_decode_graphs.py run the captured step under it on CPU, so a GPU
session does not spend its minutes finding these one capture error at a time."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# value read back to the host, or an output whose size depends on values (a sync on CUDA)
_SYNCING = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
    aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
    aten.bincount.default, aten.equal.default, aten.is_nonzero.default,
}
# a tensor made from Python data inside the step: a host-to-device copy on CUDA
_FROM_HOST = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
# factories: without an explicit device they make a host tensor, which a CUDA step then
# copies (the dispatcher fills the device in, so they are checked where Python calls them)
_FACTORIES = ("arange", "zeros", "ones", "empty", "full", "rand", "randn")


class CaptureSafety(TorchDispatchMode):
    def __enter__(self):
        self._saved = {n: getattr(torch, n) for n in _FACTORIES}
        for n, f in self._saved.items():
            setattr(torch, n, _needs_device(n, f))
        return super().__enter__()

    def __exit__(self, *exc):
        for n, f in self._saved.items():
            setattr(torch, n, f)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if func in _SYNCING:
            raise AssertionError(f"{name} reads values back to the host inside a captured step")
        if func in _FROM_HOST:
            raise AssertionError(f"{name}: a tensor made from Python data inside a captured "
                                 "step (a host-to-device copy on CUDA)")
        if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and \
                kwargs.get("output_size") is None and (len(args) < 3 or args[-1] is None):
            raise AssertionError(f"{name} without output_size sizes its output from values")
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            for ix in args[1]:
                if ix is not None and ix.dtype == torch.bool:
                    raise AssertionError(f"{name} with a boolean mask sizes its output from "
                                         "values")
        return func(*args, **kwargs)


def _needs_device(name: str, factory):
    def made(*args, **kwargs):
        if kwargs.get("device") is None and kwargs.get("out") is None:
            raise AssertionError(f"torch.{name} without a device inside a captured step: a "
                                 "host tensor on CUDA, copied to the device (give it device=)")
        return factory(*args, **kwargs)
    return made
