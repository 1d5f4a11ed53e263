"""Speculative decoding on a Kimi K3 target: n-gram and DSpark in the released k3_dspark layout
(q-LoRA MLA, interleaved YaRN RoPE, the target's mask-token embedding, markov_head names) leave
greedy output token-identical, also with prefix hits, chunked prefill and preemption."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from k3_models import k3_raw, write_k3_checkpoint
from kdaserve import LLM, SamplingParams
from kdaserve.model.dspark import DraftConfig, DSparkDraft
from kdaserve.model.registry import load_draft

YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3")
    write_k3_checkpoint(out, k3_raw(mxfp4=True), seed=5)
    return out


@pytest.fixture(scope="module")
def k3_draft(k3_dir, tmp_path_factory):
    """A random draft written in the released layout, reading the running sum P of layers 1, 4."""
    torch.manual_seed(0)
    dc = DraftConfig(hidden_size=64, vocab_size=96, target_layer_ids=(1, 4), block_size=7,
                     num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16,
                     kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     intermediate_size=64, markov_rank=8, rope_theta=50000.0,
                     layout="k3_dspark", mask_token_id=94, rope_interleaved=True,
                     rope_scaling=YARN)
    draft = DSparkDraft(dc)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    out = tmp_path_factory.mktemp("k3_draft")
    draft.save_pretrained(out)
    return out


def _greedy(llm, prompts, n=16):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.engine.cache.all_free()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    base = torch.randint(2, 90, (12,), generator=g).tolist()
    return [base * 3, base[:5] * 4 + [7, 8], torch.randint(2, 90, (33,), generator=g).tolist()]


def test_released_layout_names(k3_draft):
    cfg = json.loads((k3_draft / "config.json").read_text())
    assert cfg["model_type"] == "k3_dspark" and cfg["rope_parameters"]["rope_type"] == "yarn"
    names = set(load_file(str(k3_draft / "model.safetensors")))
    assert {"final_norm.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "context_proj.weight", "layers.0.self_attn.q_a_proj.weight"} <= names
    assert not any(n.startswith(("mask_embedding", "norm.", "markov_in")) for n in names)
    draft = load_draft(k3_draft)
    assert draft.layers[0].self_attn.rope_interleaved
    assert abs(draft.layers[0].self_attn.scale - (16 ** -0.5) * (0.1 * torch.log(
        torch.tensor(32.0)).item() + 1) ** 2) < 1e-9


def test_released_layout_extra_tensors_load(k3_draft, tmp_path):
    """The released file carries a copy of the target embedding and a confidence head, and
    may prefix names with `model.`: those load (and are not used)."""
    state = load_file(str(k3_draft / "model.safetensors"))
    state = {f"model.{k}": v for k, v in state.items()}
    state["embed_tokens.weight"] = torch.zeros(96, 64)
    state["confidence_head.proj.weight"] = torch.zeros(1, 72)
    from safetensors.torch import save_file
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((k3_draft / "config.json").read_text())
    load_draft(tmp_path)


@pytest.mark.parametrize("method", ["ngram", "dspark"])
def test_speculation_identical_on_k3(k3_dir, k3_draft, prompts, method):
    plain = LLM(str(k3_dir), block_size=4)
    # each prompt also holds its own continuation once, so n-gram lookup finds drafts
    prompts = [p + out + p for p, out in zip(prompts, _greedy(plain, prompts))]
    ref = _greedy(plain, prompts)
    kw = {"speculative_model": str(k3_draft)} if method == "dspark" else {}
    llm = LLM(str(k3_dir), block_size=4, speculative_method=method,
              speculative_adaptive=False, num_speculative_tokens=5,
              max_num_batched_tokens=16, **kw)
    assert _greedy(llm, prompts) == ref
    assert _greedy(llm, prompts) == ref           # again, from prefix-cache hits
    assert llm.engine.scheduler.num_draft_tokens > 0


def test_preemption_identical_on_k3(k3_dir, prompts):
    """A cache of a few blocks forces preemption and recompute."""
    ref = _greedy(LLM(str(k3_dir), block_size=4), prompts)
    llm = LLM(str(k3_dir), block_size=4, num_blocks=14, enable_prefix_caching=False)
    assert _greedy(llm, prompts * 2) == ref * 2
