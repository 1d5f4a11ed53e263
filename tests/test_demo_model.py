"""The bundled Kimi Linear demo: loads through kdaserve and transformers with the same greedy
tokens. (The K3 demo that `kdaserve serve` serves: tests/test_k3_demo_model.py.)"""

from __future__ import annotations

import torch

from kdaserve import LLM, SamplingParams
from kdaserve.assets import kimi_linear_demo_path
from kdaserve.model.registry import load_config


def test_bundled_model_is_a_small_hybrid_moe():
    path = kimi_linear_demo_path()
    cfg = load_config(path)
    assert len(cfg.kda_layers) == 3 * len(cfg.mla_layers)
    assert cfg.num_experts == 32 and cfg.num_experts_per_token == 4
    assert cfg.moe_layers[0] == 1 and cfg.num_shared_experts >= 1
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "model.safetensors"):
        assert (path / name).is_file(), name
    assert (path / "model.safetensors").stat().st_size < 30 * 2**20


def test_greedy_matches_transformers():
    from transformers import KimiLinearForCausalLM

    path = kimi_linear_demo_path()
    llm = LLM(str(path))
    prompt = "ROMEO:\nBut soft, what light"
    ids = llm.tokenizer.encode(prompt)
    ours = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    hf = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                          repetition_penalty=1.0, top_p=None, temperature=None,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert ours.token_ids == ref
    assert ours.text == llm.tokenizer.decode(ref)
