"""The vision tower in both checkpoint layouts kdaserve loads: kimi_k3 (MoonViT-V2 fields in a
`vision_config` with the released `vt_*` names, text under `language_model.`) and kimi_k25
(kdaserve's own save, in the released names); text-only fallbacks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from k3_models import k3_raw, random_k3
from safetensors import safe_open

from kdaserve.config import ConfigError
from kdaserve.model.loader import load_model, save_model
from kdaserve.model.registry import load_config
from kdaserve.model.vision.config import VisionConfig
from kdaserve.model.vision.processor import preprocess
from kdaserve.model.vision.tower import vision_config_of

V2 = {"model_type": "kimi_k3_vision", "vt_hidden_size": 32, "vt_intermediate_size": 48,
      "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2, "qkv_hidden_size": 48,
      "patch_size": 14, "init_pos_emb_height": 6, "init_pos_emb_width": 6,
      "merge_kernel_size": [2, 2], "mm_hidden_size": 32, "text_hidden_size": 64,
      "norm_type": "rmsnorm", "attn_bias": False, "linear_bias": False,
      "patch_embed_proj_bias": False, "pos_emb_interpolation_mode": "bilinear",
      "mm_projector_type": "patchmergerv2", "projector_ln_eps": 1e-5}


def pixels(sizes, seed=0):
    from PIL import Image
    rng = np.random.default_rng(seed)
    pp = [preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
          for h, w in sizes]
    return torch.from_numpy(np.concatenate([p.pixels for p in pp])), [p.grid for p in pp]


def test_k3_layout_with_moonvit_v2(tmp_path):
    raw = {**k3_raw(), "vision_config": V2}
    cfg = load_config(raw)
    vc = vision_config_of(cfg)
    assert (vc.attn_width, vc.head_dim, vc.norm_type, vc.projector_type) == \
        (48, 24, "rmsnorm", "patchmergerv2")
    model = random_k3(cfg)
    save_model(model, tmp_path)
    names = set(safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in names
    assert "vision_tower.encoder.blocks.1.wqkv.bias" not in names
    assert {"mm_projector.proj.0.weight", "mm_projector.post_norm.weight",
            "vision_tower.patch_embed.pos_emb.weight"} <= names
    assert all(n.startswith(("language_model.", "vision_tower.", "mm_projector."))
               for n in names)
    assert json.loads((tmp_path / "config.json").read_text())["vision_config"] == V2
    loaded = load_model(tmp_path, progress=False)
    pix, grids = pixels([(60, 90), (84, 84)])
    with torch.no_grad():
        a, b = model.encode_images(pix, grids), loaded.encode_images(pix, grids)
    assert [x.shape for x in a] == [(12, 64), (9, 64)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_position_table_is_used_as_is_at_its_own_size():
    cfg = VisionConfig.from_dict(V2, 64)
    from kdaserve.model.vision.moonvit import PositionEmbedding
    pe = PositionEmbedding(cfg)
    with torch.no_grad():
        pe.weight.normal_()
    assert torch.equal(pe.grid(6, 6), pe.weight.reshape(36, -1))
    assert pe.grid(4, 10).shape == (40, 32)


def test_vision_config_without_sizes_builds_text_only(tmp_path):
    cfg = load_config(k3_raw())       # vision_config {"model_type": ...} only
    assert vision_config_of(cfg) is None
    model = random_k3(cfg)
    assert not hasattr(model, "vision_tower")


def test_checkpoint_without_vision_weights_loads_text_only(tmp_path):
    cfg = load_config({**k3_raw(), "vision_config": V2})
    model = random_k3(cfg)
    model.drop_vision()
    save_model(model, tmp_path)
    loaded = load_model(tmp_path, progress=False)
    assert not hasattr(loaded, "vision_tower")
    ids = torch.tensor([[3, 5, 7, 9]])
    assert torch.equal(loaded.forward_dense(ids), model.forward_dense(ids))


def test_bad_vision_config_names_the_field():
    with pytest.raises(ConfigError, match="norm_type"):
        VisionConfig.from_dict({**V2, "norm_type": "batchnorm"}, 64)
    with pytest.raises(ConfigError, match="text_config"):
        load_config({"model_type": "kimi_k25",
                               "text_config": {"model_type": "deepseek_v3"}})
