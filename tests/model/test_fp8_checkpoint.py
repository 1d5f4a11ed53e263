"""Block-scaled FP8 checkpoints (DeepSeek-V3's `weight_scale_inv` layout) load dequantized:
each weight equals compressed-tensors' own FP8 block dequantizer's output, so the model is
the float model of those weights; --quantization re-packs them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import random_model, tiny_config

from kdaserve.model.loader import load_model, save_model
from kdaserve.model.quant_linear import QuantLinear
from kdaserve.ops.fp8_block import FP8, dequantize_fp8_blocks, quantize_fp8_blocks
from kdaserve.quant_config import from_scheme

CFG = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48,
       "kv_lora_rank": 32}
BLOCK = (32, 32)        # the tiny model's widths; real checkpoints: 128 x 128


def _fp8_checkpoint(tmp_path):
    cfg = tiny_config(**CFG)
    save_model(random_model(cfg), tmp_path / "float")
    state = load_file(str(tmp_path / "float" / "model.safetensors"))
    out, want = {}, {}
    for name, t in state.items():
        if name.endswith("_proj.weight") or ".experts." in name or name == "lm_head.weight":
            q, s = quantize_fp8_blocks(t, BLOCK)
            out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q, s
            want[name] = (q, s)
        else:
            out[name] = t
    (tmp_path / "fp8").mkdir()
    save_file(out, str(tmp_path / "fp8" / "model.safetensors"))
    raw = json.loads((tmp_path / "float" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(raw))
    return cfg, want


def test_fp8_blocks_load_as_compressed_tensors_dequantizes_them(tmp_path):
    ct = pytest.importorskip("compressed_tensors.entrypoints.convert.converters."
                             "fp8block_dequantizer")
    cfg, want = _fp8_checkpoint(tmp_path)
    m = load_model(tmp_path / "fp8", progress=False)
    state = m.state_dict()
    deq = ct.FP8BlockDequantizer(weight_block_size=BLOCK, dtype=torch.float32)
    name = "model.layers.0.self_attn.o_proj.weight"
    q, s = want[name]
    assert q.dtype == FP8
    theirs = deq._create_dequantized_weight(q, s)
    assert torch.equal(state[name], theirs) and torch.equal(dequantize_fp8_blocks(q, s, BLOCK),
                                                            theirs)
    w1 = want["model.layers.1.block_sparse_moe.experts.2.w1.weight"]
    i = cfg.moe_intermediate_size
    assert torch.equal(m.model.layers[1].block_sparse_moe.experts_w13[2, :i],
                       deq._create_dequantized_weight(*w1))
    # the model equals the float checkpoint of the package's dequantized weights, bit for bit
    state = load_file(str(tmp_path / "float" / "model.safetensors"))
    state.update({n: deq._create_dequantized_weight(q, s).contiguous()
                  for n, (q, s) in want.items()})
    save_file(state, str(tmp_path / "float" / "model.safetensors"))
    f = load_model(tmp_path / "float", progress=False)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m.forward_dense(ids), f.forward_dense(ids))


def test_fp8_checkpoint_quantized_on_load(tmp_path):
    _fp8_checkpoint(tmp_path)
    m = load_model(tmp_path / "fp8", progress=False, quantization=from_scheme("int8", 32))
    assert isinstance(m.model.layers[0].self_attn.q_proj, QuantLinear)


def test_unpaired_scale_is_an_error(tmp_path):
    _fp8_checkpoint(tmp_path)
    path = tmp_path / "fp8" / "model.safetensors"
    state = load_file(str(path))
    del state["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(state, str(path))
    with pytest.raises(ValueError, match="pair"):
        load_model(tmp_path / "fp8", progress=False)
