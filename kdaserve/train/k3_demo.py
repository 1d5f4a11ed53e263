"""`kdaserve train --arch kimi_k3`: the bundled demo as a tiny Kimi K3 that reads images.

The text model has K3's block (attention residuals, SiTU, latent MoE, full-rank KDA gate with a
lower bound, gated MLA with a q LoRA) at the demo's scale; a MoonViT tower and its projector sit
beside it in the kimi_k3 layout. One optimiser trains both, in the same steps: the
Shakespeare text batch of the Kimi Linear demo (kdaserve/train/text_demo.py) plus a batch of the
synthetic shapes task (kdaserve/train/shapes.py, the loss on the answers), with the vision demo's
mean-pool probe as an auxiliary loss on the tower (kdaserve/train/vision_demo.py says why).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

from kdaserve.model.base import HybridForCausalLM
from kdaserve.model.registry import hf_config, load_config
from kdaserve.model_config import ModelConfig
from kdaserve.tokenizer import Tokenizer
from kdaserve.train.bpe import DEFAULT_SPECIALS, save_tokenizer
from kdaserve.train.shapes import COLORS, HELD_OUT_SEED, QUESTIONS, SHAPES
from kdaserve.train.text_demo import text_data, write_generation_config, write_summary
from kdaserve.train.trainer import TrainConfig, init_weights, train
from kdaserve.train.vision_demo import MEDIA_TOKENS, Examples, accuracy, step_loss
from kdaserve.vision_input import VisionInput


def k3_demo_config(vocab: int, eos: list[int], pad: int, placeholder: int) -> ModelConfig:
    """~12.7M parameters (25 MB in bf16): 8 layers, KDA at 1-3 and 5-7, MLA at 4 and 8, two
    attention-residual blocks of four layers, 40 latent experts (top-4, width 128) + one shared."""
    text = {
        "model_type": "kimi_linear", "vocab_size": vocab, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 8, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8],
                               "num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 40, "num_experts_per_token": 4, "num_shared_experts": 1,
        "moe_intermediate_size": 64, "routed_expert_hidden_size": 128,
        "latent_moe_use_norm": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
        "routed_scaling_factor": 2.0, "model_max_length": 1 << 20,
        "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None,
    }
    vision = {"vt_hidden_size": 64, "vt_intermediate_size": 128, "vt_num_hidden_layers": 2,
              "vt_num_attention_heads": 4, "patch_size": 14, "init_pos_emb_height": 20,
              "init_pos_emb_width": 20, "merge_kernel_size": [2, 2], "mm_hidden_size": 64,
              "text_hidden_size": 256, "mm_projector_type": "patchmerger",
              "projector_ln_eps": 1e-5}
    return load_config({"model_type": "kimi_k3", "text_config": text,
                                  "vision_config": vision,
                                  "media_placeholder_token_id": placeholder})


@torch.no_grad()
def init_k3(model: HybridForCausalLM, seed: int) -> None:
    """The text model as the Kimi Linear demo; the attention-residual queries at zero (each
    block then starts as the mean of what came before, as the AttnRes paper initialises them);
    the tower at 1/sqrt(fan-in) with zero biases (vision_demo.train says why)."""
    init_weights(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("_res_proj.weight"):
            p.zero_()
        elif name.startswith("vision_tower."):
            if p.dim() >= 2:
                p.normal_(0, 1 / math.sqrt(p[0].numel()), generator=g)
            elif name.endswith("bias"):
                p.zero_()
        elif name.startswith("mm_projector.") and name.endswith("bias"):
            p.zero_()


class ShapesTask:
    """The trainer's auxiliary task: a batch of shapes examples per step."""

    def __init__(self, ex: Examples, hidden: int, batch_size: int, seed: int,
                 eval_images: int = 24) -> None:
        self.ex, self.batch_size, self.eval_images = ex, batch_size, eval_images
        self.probe = torch.nn.Linear(hidden, len(COLORS) * len(SHAPES))
        self.rng = random.Random(seed)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.probe.parameters())

    def loss(self, model: HybridForCausalLM) -> torch.Tensor:
        batch = [self.ex.example(self.rng.randrange(HELD_OUT_SEED))
                 for _ in range(self.batch_size)]
        return step_loss(model, batch, self.probe)

    def evaluate(self, model: HybridForCausalLM) -> dict:
        seeds = range(HELD_OUT_SEED, HELD_OUT_SEED + self.eval_images)
        return {"image_accuracy": round(accuracy(model, self.ex, seeds), 4)}


def build(out: Path, *, minutes: float, seed: int, train_cfg: TrainConfig,
          image_batch: int = 8, resume: Path | None = None, vocab_size: int = 4096,
          chat_share: float = 0.25) -> dict:
    # the questions and answers in the tokenizer's corpus, so "triangle" is not 3 pieces
    shapes_text = [q for q in QUESTIONS] + [f"a {c} {s}" for c in COLORS for s in SHAPES]
    data = text_data(vocab_size=vocab_size, seed=seed, chat_share=chat_share, resume=resume,
                     specials=DEFAULT_SPECIALS + MEDIA_TOKENS,
                     extra_tokenizer_texts=shapes_text * 50)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(data.tok, out)
    tok = Tokenizer.from_pretrained(out)
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "<|pad|>",
                                            "<|media_pad|>")}
    model_cfg = k3_demo_config(tok.vocab_size, [ids["<|endoftext|>"], ids["<|im_end|>"]],
                               ids["<|pad|>"], ids["<|media_pad|>"])
    # VisionInput reads the checkpoint's config.json: written before the model exists
    (out / "config.json").write_text(json.dumps(hf_config(model_cfg), indent=2) + "\n")
    vision = VisionInput.for_model(out, tok)
    task = ShapesTask(Examples(tok, vision, ids["<|im_end|>"]), model_cfg.hidden_size,
                      image_batch, seed)
    cfg = TrainConfig(**{**train_cfg.__dict__, "time_budget_s": minutes * 60, "seed": seed})
    result = train(model_cfg, data.train_ids, data.eval_ids, cfg, out_dir=out,
                   init_from=resume, aux=task, init=init_k3)
    result["aux"] = {**result.get("aux", {}),
                     "image_accuracy_200": accuracy(result["model"], task.ex, range(
                         HELD_OUT_SEED, HELD_OUT_SEED + 200))}
    write_generation_config(out, data.tok)
    return write_summary(out, result, data)
