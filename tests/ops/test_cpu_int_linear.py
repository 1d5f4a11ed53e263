"""The compiled products over packed INT8/INT4 weights (kdaserve.ops.cpu_int_linear) against
their oracles. The fp32 decode (KDASERVE_INT_DOT=0, and shapes the integer dots do not take)
against dequantize-then-matmul: the weights it multiplies by are the oracle's bit for bit, the
sums within fp32 rounding of the exact product. The integer dots (csrc/int_dot.h, the default)
against int_quant.int_dot_oracle, bit for bit. Either way each row independent of its batch and
of the thread count."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import needs_kernels, require

from kdaserve.model.quant_linear import QuantLinear, reference
from kdaserve.ops import cpu_int_linear
from kdaserve.ops.cpu_int_linear import rows_product
from kdaserve.ops.int_quant import dequantize, int_dot_applies, int_dot_oracle, quantize

pytestmark = needs_kernels

# (outputs, inputs, group, symmetric): ragged last groups, odd widths, zero points
SHAPES = [(37, 64, 32, True), (16, 48, 32, False), (9, 100, 16, True), (5, 7, 4, False),
          (130, 256, 128, True), (4, 33, 8, True)]


@pytest.fixture(autouse=True)
def _built():
    require(cpu_int_linear._kernel(), "the packed INT product (csrc/int_rows.h)")


@pytest.fixture
def fp32_decode(monkeypatch):
    monkeypatch.setenv("KDASERVE_INT_DOT", "0")


def _layer(bits: int, n: int, k: int, group: int, symmetric: bool) -> QuantLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k + bits))
    return QuantLinear.from_weight(w, bits, group, symmetric)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k,group,symmetric", SHAPES)
def test_decoded_weights_are_the_oracles(bits, n, k, group, symmetric) -> None:
    """Unit input rows pick single weights out: the product's weights, bit for bit."""
    layer = _layer(bits, n, k, group, symmetric)
    eye = torch.eye(k)
    got = rows_product(eye, layer.weight_packed, layer.weight_scale, layer.weight_zero_point,
                       bits, layer.group, n, act8=False)
    assert torch.equal(got, layer.dequantized().t())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k,group,symmetric", SHAPES)
def test_product_within_fp32_rounding_of_the_oracle(bits, n, k, group, symmetric,
                                                    fp32_decode) -> None:
    layer = _layer(bits, n, k, group, symmetric)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(k))
    with torch.no_grad():
        assert cpu_int_linear.applies(x, layer)
        y = layer(x)
        w = layer.dequantized()
        exact = (x.double() @ w.double().t())
        # a sum of k products in fp32: within k * 2^-24 of the sum of magnitudes (the oracle,
        # F.linear, sums in another order and is bounded the same way)
        bound = (k + 2) * 2.0 ** -24 * (x.abs().double() @ w.abs().double().t())
        assert ((y.double() - exact).abs() <= bound).all()
        assert ((reference(x, layer).double() - exact).abs() <= bound).all()


# (outputs, inputs, group, symmetric): INT4 in units of two blocks, groups of one or several
# units (INT4 groups of 32: half a unit each), ragged last groups, zero points; odd outputs;
# whole symmetric groups of two and four INT4 units (several rows start at -8 A there)
INT_DOT_SHAPES = [(37, 64, 32, True), (16, 192, 64, False), (9, 320, 128, True),
                  (130, 256, 128, False), (5, 128, 32, False), (3, 96, 32, True),
                  (22, 384, 128, True), (9, 512, 256, True)]


@pytest.mark.parametrize("bits,n,k,group,symmetric",
                         [(bits, *shape) for bits in (8, 4) for shape in INT_DOT_SHAPES
                          if int_dot_applies(shape[1], shape[2], bits)])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_integer_dots_are_their_oracle(bits, n, k, group, symmetric, rows) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k + bits))
    packed, scale, zero = quantize(w, bits, group, symmetric)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :5] = 0.0                                    # a block with zeros, and a zero block
    if k >= 64:
        x[-1, 32:64] = 0.0
    got = rows_product(x, packed, scale, zero, bits, group, n, act8=True)
    assert torch.equal(got, int_dot_oracle(x, packed, scale, zero, bits, k, group))
    # and near the exact product: 8-bit activations cost about a percent of its scale
    exact = x.double() @ dequantize(packed, scale, zero, bits, k, group).double().t()
    assert (got.double() - exact).abs().max() <= 0.03 * exact.abs().max()


@pytest.mark.parametrize("int_dot", ["1", "0"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [256, 200])      # 200: a tail past the last 16 columns
def test_rows_do_not_depend_on_their_batch(bits, threads, k, int_dot, monkeypatch) -> None:
    # the fp32 decode: a lone row decodes in registers (int_rows.h q_dot_packed), several
    # through a buffer; the integer dots (k 256 only): a lone row four outputs a tile, more
    # rows two by two
    monkeypatch.setenv("KDASERVE_INT_DOT", int_dot)
    layer = _layer(bits, 300, k, 64, bits == 4)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(bits))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            batch = layer(x)
            alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
            odd = torch.cat([layer(x[:7]), layer(x[7:30]), layer(x[30:])])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch, alone) and torch.equal(batch, odd)


@pytest.mark.parametrize("bits", [8, 4])
def test_integer_dots_take_any_number_of_rows(bits, monkeypatch) -> None:
    """A prefill's chunk too, in slices (INT_DOT_SLICE) that change no row: a row's result
    does not depend on how many rows share its call, however many."""
    monkeypatch.setenv("KDASERVE_INT_DOT", "1")
    monkeypatch.setattr(cpu_int_linear, "INT_DOT_SLICE", 16)
    layer = _layer(bits, 16, 64, 64, True)      # a shape the integer dots take
    assert int_dot_applies(64, 64, bits) and cpu_int_linear.max_rows(layer) is None
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(bits))
    assert cpu_int_linear.applies(x, layer)
    with torch.no_grad():
        many = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(many, alone)
    assert torch.equal(many, int_dot_oracle(x, layer.weight_packed, layer.weight_scale,
                                            layer.weight_zero_point, bits, 64, 64))


@pytest.mark.parametrize("bits", [8, 4])
def test_many_rows_of_the_fp32_decode_and_autograd_take_the_oracle(bits, monkeypatch) -> None:
    monkeypatch.setenv("KDASERVE_INT_DOT", "0")
    layer = _layer(bits, 16, 64, 64, True)
    limit = cpu_int_linear.MAX_ROWS
    assert cpu_int_linear.max_rows(layer) == limit
    assert cpu_int_linear.applies(torch.randn(limit, 64), layer)
    x = torch.randn(limit + 1, 64)
    assert not cpu_int_linear.applies(x, layer)
    assert torch.equal(layer(x), reference(x, layer))
    monkeypatch.setenv("KDASERVE_INT_DOT", "1")
    xg = torch.randn(2, 64, requires_grad=True)
    assert not cpu_int_linear.applies(xg, layer)
    layer(xg).sum().backward()
    assert xg.grad is not None
