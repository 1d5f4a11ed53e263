"""The lone row's INT weight streams' prefetch distance (kdaserve.ops.stream_ahead and
stream_tune, csrc/int_row4.h kdaserve_set_stream_ahead): any distance gives the oracle's bits,
the measurement picks the nearest of the fastest, and a machine measures once."""

from __future__ import annotations

import json

import pytest
import torch
from compiled_kernels import needs_kernels, require

from kdaserve.ops import cpu_int_linear, cpu_isa, cpu_kernels, stream_ahead, stream_tune
from kdaserve.ops.cpu_int_linear import rows_product
from kdaserve.ops.int_quant import int_dot_oracle, quantize


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    saved = stream_ahead.chosen()
    monkeypatch.delenv(stream_ahead.ENV, raising=False)
    yield
    stream_ahead.choose(saved)


def test_pick_takes_the_nearest_distance_within_the_margin_of_the_fastest() -> None:
    assert stream_tune.pick({256: 1.00, 512: 0.95, 1024: 0.90, 2048: 0.89}) == 1024
    assert stream_tune.pick({256: 0.90, 512: 0.95, 1024: 0.89}) == 256
    assert stream_tune.pick({256: 1.00, 512: 0.97, 1024: 0.99}) == 512


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_any_distance_gives_the_oracles_bits(bits) -> None:
    """The lone row's streams (each thread's range in four runs) at distances from inside a
    unit to past the matrix: the same bits as the oracle's."""
    require(cpu_int_linear._kernel(), "the packed INT product (csrc/int_rows.h)")
    n, k, group = 203, 512, 128               # 50 tiles of four a thread's range and a tail
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(bits))
    packed, scale, zero = quantize(w, bits, group, True)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
    want = int_dot_oracle(x, packed, scale, zero, bits, k, group)
    for ahead in (64, 256, 1024, 1 << 20):
        stream_ahead.choose(ahead)
        got = rows_product(x, packed, scale, zero, bits, group, n, act8=True)
        assert torch.equal(got, want), ahead


@needs_kernels
def test_measure_times_every_candidate() -> None:
    require(cpu_int_linear._kernel(), "the packed INT product (csrc/int_rows.h)")
    seconds = stream_tune.measure(8, 4 << 20, candidates=(128, 1024), rounds=1)
    assert set(seconds) == {128, 1024} and all(0 < s < 60 for s in seconds.values())


def test_weights_in_cache_are_left_as_built(monkeypatch) -> None:
    monkeypatch.setattr(stream_tune, "measure", lambda *a, **k: pytest.fail("measured"))
    stream_ahead.choose(None)
    assert stream_tune.tune(cpu_isa.llc_bytes() // 2, 4) is None


@needs_kernels
def test_no_room_for_the_pool_is_left_as_built(monkeypatch, tmp_path) -> None:
    require(cpu_int_linear._kernel(), "the packed INT product (csrc/int_rows.h)")
    monkeypatch.setattr(cpu_kernels, "tune_dir", lambda: tmp_path / "tune")
    monkeypatch.setattr(stream_tune, "measure", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(stream_tune, "_free_bytes", lambda: 512 << 20)
    stream_ahead.choose(None)
    assert stream_tune.tune(1 << 40, 4) is None and stream_ahead.current() == 256


def test_the_environment_sets_the_distance_without_measuring(monkeypatch) -> None:
    monkeypatch.setattr(stream_tune, "measure", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setenv(stream_ahead.ENV, "768")
    assert stream_tune.tune(1 << 40, 8) == 768
    stream_ahead.choose(None)
    monkeypatch.setenv(stream_ahead.ENV, "0")             # as built
    assert stream_tune.tune(1 << 40, 8) is None
    monkeypatch.setenv(stream_ahead.ENV, "1k")
    with pytest.raises(ValueError, match="number of bytes"):
        stream_tune.tune(1 << 40, 8)


@needs_kernels
def test_a_machine_measures_once(monkeypatch, tmp_path) -> None:
    require(cpu_int_linear._kernel(), "the packed INT product (csrc/int_rows.h)")
    monkeypatch.setattr(cpu_kernels, "tune_dir", lambda: tmp_path / "tune")
    calls = []

    def fake(bits, pool_bytes, *a, **k):
        calls.append((bits, pool_bytes))
        return {256: 1.0, 512: 0.9, 1024: 0.8}

    monkeypatch.setattr(stream_tune, "measure", fake)
    big = 4 * cpu_isa.llc_bytes()
    assert stream_tune.tune(big, 4, threads=2) == 1024
    assert len(calls) == 1 and 256 << 20 <= calls[0][1] <= 1 << 30
    (kept,) = (tmp_path / "tune").glob("stream-ahead-*.json")
    assert json.loads(kept.read_text())["bytes"] == 1024
    assert stream_tune.tune(big, 4, threads=2) == 1024 and len(calls) == 1   # this process's
    stream_ahead.choose(None)                                                  # a new process
    assert stream_tune.tune(big, 4, threads=2) == 1024 and len(calls) == 1
    stream_ahead.choose(None)
    assert stream_tune.tune(big, 8, threads=2) == 1024 and len(calls) == 2   # its own key
