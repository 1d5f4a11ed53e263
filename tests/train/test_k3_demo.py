"""The K3 demo trainer (`kdaserve train --arch kimi_k3`): text and the shapes task in the same
steps. On a tiny K3 with a tower: the image task's probe trains with the model, its accuracy is
reported with each evaluation, the attention-residual queries start at zero, and the written
checkpoint (bf16, kimi_k3 layout) is served by the engine, text and image prompts alike."""

from __future__ import annotations

import copy
import json

import torch

from kdaserve.engine.llm import LLM
from kdaserve.model.registry import build_model, hf_config, load_config
from kdaserve.request import SamplingParams
from kdaserve.train.k3_demo import ShapesTask, init_k3, k3_demo_config
from kdaserve.train.shapes import draw
from kdaserve.train.trainer import TrainConfig, train
from kdaserve.train.vision_demo import Examples, build_tokenizer
from kdaserve.vision_input import VisionInput
from k3_models import K3_TINY
from test_vision_demo import data_url

VISION = {"vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_hidden_layers": 1,
          "vt_num_attention_heads": 2, "patch_size": 14, "init_pos_emb_height": 20,
          "init_pos_emb_width": 20, "merge_kernel_size": [2, 2], "mm_hidden_size": 32,
          "text_hidden_size": 64, "mm_projector_type": "patchmerger", "projector_ln_eps": 1e-5}


def test_the_bundled_configs_shape():
    cfg = k3_demo_config(4096, [0, 2], 3, 7)
    assert cfg.architecture == "kimi_k3" and cfg.attn_res_block_size == 4
    assert cfg.hidden_act == "situ" and cfg.routed_expert_hidden_size == 128
    assert cfg.mla_use_output_gate and cfg.kda_full_rank_gate
    model = build_model(cfg, chunk_size=16)
    params = sum(p.numel() for p in model.parameters())
    assert 2 * params < 30_000_000          # under 30 MB in bf16, the tower included
    init_k3(model, 0)
    res = [p for n, p in model.named_parameters() if n.endswith("_res_proj.weight")]
    assert res and all(bool((p == 0).all()) for p in res)


def test_text_and_images_train_together_into_a_servable_checkpoint(tmp_path):
    torch.set_num_threads(1)
    tok = build_tokenizer(tmp_path)
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "<|pad|>",
                                            "<|media_pad|>")}
    raw = copy.deepcopy(K3_TINY)
    raw["text_config"].update(vocab_size=tok.vocab_size, pad_token_id=ids["<|pad|>"],
                              eos_token_id=[ids["<|endoftext|>"], ids["<|im_end|>"]])
    raw.update(vision_config=VISION, media_placeholder_token_id=ids["<|media_pad|>"])
    cfg = load_config(raw)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg)))
    task = ShapesTask(Examples(tok, VisionInput.for_model(tmp_path, tok), ids["<|im_end|>"]),
                      cfg.hidden_size, batch_size=2, seed=0, eval_images=2)
    probe_before = task.probe.weight.detach().clone()
    g = torch.Generator().manual_seed(0)
    text = torch.randint(8, tok.vocab_size, (4000,), generator=g)
    result = train(cfg, text, text[:600], TrainConfig(seq_len=32, batch_size=2, max_steps=4,
                                                      eval_every=2, warmup_steps=1,
                                                      eval_batches=1),
                   out_dir=tmp_path, log=lambda _: None, aux=task, init=init_k3)
    assert result["steps"] == 4
    assert [h["step"] for h in result["history"]] == [2, 4]
    assert all("image_accuracy" in h for h in result["history"])
    assert "image_accuracy" in result["aux"]
    assert not torch.equal(task.probe.weight, probe_before)       # in the optimiser

    llm = LLM(str(tmp_path), max_model_len=1024, num_threads=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    s = draw(5)
    out = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": s.question},
        {"type": "image_url", "image_url": {"url": data_url(s.image)}}]}], greedy,
        use_tqdm=False)[0]
    assert out.outputs[0].token_ids
    assert llm.generate(["a red"], greedy, use_tqdm=False)[0].outputs[0].token_ids
