"""The demo `kdaserve serve` serves: a tiny Kimi K3 (attention residuals, SiTU, latent MoE,
gated KDA/MLA) with its MoonViT tower and its DSpark draft, under 30 MB. Its text greedy tokens
equal mlx-lm's kimi_k3 on the same checkpoint, and its draft leaves greedy output unchanged
while drafts stand. (Its vision, over HTTP: tests/server/test_vision_demo_server.py.)"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from kdaserve import LLM, SamplingParams
from kdaserve.assets import default_model_path
from kdaserve.model.registry import load_config

PROMPT = "ROMEO:\nBut soft, what light"


@pytest.fixture(scope="module")
def demo():
    return LLM(str(default_model_path()), max_model_len=1024, cache_memory=64 << 20,
               num_threads=1)


def test_the_demo_is_a_tiny_k3_that_reads_images():
    path = default_model_path()
    cfg = load_config(path)
    assert cfg.architecture == "kimi_k3"
    assert cfg.attn_res_block_size and cfg.hidden_act == "situ"
    assert cfg.routed_expert_hidden_size and cfg.mla_use_output_gate and cfg.kda_full_rank_gate
    assert cfg.vision_config is not None and cfg.media_placeholder_token_id is not None
    assert len(cfg.kda_layers) == 3 * len(cfg.mla_layers)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "model.safetensors", "training_summary.json", "draft/config.json",
                 "draft/model.safetensors"):
        assert (path / name).is_file(), name
    assert (path / "model.safetensors").stat().st_size < 30 * 2**20


def test_text_greedy_matches_mlx(tmp_path):
    """In fp32 on both sides (mlx's CPU expert matmul takes fp32 only): the bf16 weights
    upcast exactly."""
    pytest.importorskip("mlx_lm.models.kimi_k3")
    from k3_models import mlx_greedy

    src = default_model_path()
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    weights = load_file(src / "model.safetensors")
    save_file({k: v.float() for k, v in weights.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=1024, num_threads=1)
    ids = llm.tokenizer.encode(PROMPT)
    want = mlx_greedy(tmp_path, [ids], 16)[0]
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16,
                                              ignore_eos=True), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == want


def test_the_draft_keeps_greedy_output_and_its_drafts_stand(demo):
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [PROMPT, "The weather today is", "KING LEAR:\nCome, let us"]
    plain = [o.outputs[0].token_ids for o in demo.generate(prompts, sp, use_tqdm=False)]
    spec = LLM(str(default_model_path()), max_model_len=1024, cache_memory=64 << 20,
               num_threads=1, speculative_method="dspark", num_speculative_tokens=4,
               speculative_adaptive=False)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)] == plain
    s = spec.engine.scheduler
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens / s.num_draft_tokens > 0.2
