"""LLM(shared_weights=other): a second engine serves the first one's model, the same bytes in
memory (bench spec compares plain and speculative engines on them), without preparing it a
second time, and refuses a configuration the model was not prepared for."""

from __future__ import annotations

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.model.kda import KimiDeltaAttention


def _greedy(llm, prompts, n=12):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _pointers(model) -> dict[str, int]:
    out = {name: p.data_ptr() for name, p in model.named_parameters()}
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.self_attn, KimiDeltaAttention) and layer.self_attn._fused is not None:
            out[f"fused{i}"] = layer.self_attn._fused.data_ptr()
    return out


def test_a_second_engine_reads_the_same_weights(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in (3, 17, 30)]
    ref = _greedy(LLM(str(path)), prompts)
    base = LLM(str(path))
    before = _pointers(base.engine.model)
    assert any(k.startswith("fused") for k in before)     # the KDA projections were fused
    other = LLM(str(path), shared_weights=base, speculative_method="ngram",
                num_speculative_tokens=3, speculative_adaptive=False)
    assert other.engine.model is base.engine.model
    # preparing it again changed nothing: no projection fused (copied) a second time
    assert _pointers(other.engine.model) == before
    assert _greedy(other, prompts) == ref
    assert _greedy(base, prompts) == ref


def test_a_differently_prepared_engine_is_refused(hf_checkpoint):
    path, _ = hf_checkpoint
    base = LLM(str(path))
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(path), shared_weights=base, dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(path), shared_weights=base, quantization="int8")
