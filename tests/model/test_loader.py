"""Checkpoint loading: sharded files, dtypes, name aliases, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kdaserve.model.loader import CheckpointError, load_model, save_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_identically(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint
    state = load_file(str(path / "model.safetensors"))
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(path / "config.json", out / "config.json")
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(out / file))
        weight_map.update({k: file for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = load_model(path, progress=False)
    b = load_model(out, progress=False)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)


def test_bf16_checkpoint_and_fp32_router(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint
    m = load_model(path, progress=False)
    save_model(m, tmp_path / "bf16", dtype=torch.bfloat16)
    b = load_model(tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert b.model.embed_tokens.weight.dtype == torch.bfloat16
    assert b.model.layers[1].block_sparse_moe.gate.weight.dtype == torch.float32
    assert b.model.layers[0].self_attn.A_log.dtype == torch.float32
    assert torch.equal(b.model.layers[3].self_attn.kv_b_proj.weight,
                       m.model.layers[3].self_attn.kv_b_proj.weight.to(torch.bfloat16))
    with torch.no_grad():
        assert torch.isfinite(b.forward_dense(torch.arange(3, 20)[None]).float()).all()


def test_dense_mlp_accepts_both_names(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint
    state = load_file(str(path / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in state  # transformers' naming
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v
               for k, v in state.items()}
    out = _copy(path, tmp_path / "released_names")
    save_file(renamed, str(out / "model.safetensors"))
    a, b = load_model(path, progress=False), load_model(out, progress=False)
    assert torch.equal(a.model.layers[0].mlp.gate_proj.weight,
                       b.model.layers[0].mlp.gate_proj.weight)


def test_missing_and_misshaped_tensors_are_named(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint
    state = load_file(str(path / "model.safetensors"))
    out = _copy(path, tmp_path / "broken")
    missing = dict(state)
    missing.pop("model.layers.2.self_attn.f_b_proj.weight")
    save_file(missing, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="f_b_proj"):
        load_model(out, progress=False)
    bad = dict(state)
    bad["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(5, 5)
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"kv_b_proj.*\(5, 5\).*expected"):
        load_model(out, progress=False)
    extra = dict(state)
    extra["model.layers.0.self_attn.surprise"] = torch.zeros(1)
    save_file(extra, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="surprise"):
        load_model(out, progress=False)


def test_no_weights_is_a_clear_error(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint
    out = tmp_path / "empty"
    out.mkdir()
    shutil.copy(path / "config.json", out / "config.json")
    (out / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(out, progress=False)


def test_saved_checkpoint_loads_in_transformers(hf_checkpoint, tmp_path):
    from transformers import KimiLinearForCausalLM

    path, hf = hf_checkpoint
    m = load_model(path, progress=False)
    save_model(m, tmp_path / "ours")
    back = KimiLinearForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() < 1e-5


def test_missing_or_misshaped_expert_is_named(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint
    state = load_file(str(path / "model.safetensors"))
    out = _copy(path, tmp_path / "experts")
    missing = dict(state)
    missing.pop("model.layers.2.block_sparse_moe.experts.5.w3.weight")
    save_file(missing, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.block_sparse_moe\.experts\.5\.w3"):
        load_model(out, progress=False)
    bad = dict(state)
    bad["model.layers.1.block_sparse_moe.experts.0.w2.weight"] = torch.zeros(3, 3)
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w2.*\(3, 3\)"):
        load_model(out, progress=False)
