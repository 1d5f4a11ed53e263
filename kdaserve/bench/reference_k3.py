"""`kdaserve bench reference --arch kimi_k3`: kdaserve's K3 vs mlx-lm's kimi_k3, in one run.

A random K3 checkpoint in the released layout (attention-residuals, SiTU with the up clip,
latent MoE with its norm, q-LoRA, gated KDA/MLA, MXFP4 routed experts) is loaded by both. It
reports the max abs difference of the last-position logits, whether greedy continuations are
token-identical (kdaserve's engine with its cache vs mlx-lm with its own), and one full
forward's time on each side (same input, interleaved repeats, best of each)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kdaserve.model.loader import load_model, save_model
from kdaserve.model.random_init import init_random
from kdaserve.model.registry import build_model, load_config


def bench_config(vocab: int = 4096, hidden: int = 256, layers: int = 8) -> dict:
    kda = [i for i in range(1, layers + 1) if i % 4 and i != layers]
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "quantization_config": {"quant_method": "compressed-tensors",
                                "format": "mxfp4-pack-quantized"},
        "text_config": {
            "model_type": "kimi_linear", "vocab_size": vocab, "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 512, "rms_norm_eps": 1e-6,
            "linear_attn_config": {
                "kda_layers": kda, "full_attn_layers": [i for i in range(1, layers + 1)
                                                        if i not in kda],
                "num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4,
                "use_full_rank_gate": True, "gate_lower_bound": -5.0},
            "hidden_act": "situ", "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0, "attn_res_block_size": 3,
            "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": True,
            "mla_use_output_gate": True, "num_experts": 32, "num_experts_per_token": 4,
            "num_shared_experts": 1, "moe_intermediate_size": 128,
            "routed_expert_hidden_size": 128, "latent_moe_use_norm": True,
            "first_k_dense_replace": 1, "moe_router_activation_func": "sigmoid",
            "num_expert_group": 1, "topk_group": 1, "routed_scaling_factor": 2.0,
            "tie_word_embeddings": False, "eos_token_id": 2},
        "vision_config": {"model_type": "kimi_k3_vision"}, "media_placeholder_token_id": 4095,
    }


def mlx_greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from an mlx-lm model with its own incremental cache."""
    import mlx.core as mx

    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)
    toks: list[int] = []
    for _ in range(n):
        toks.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[toks[-1]]]), cache=cache)
    return toks


def write_checkpoint(out: Path, seed: int) -> None:
    cfg = load_config(bench_config())
    torch.manual_seed(seed)
    save_model(init_random(build_model(cfg), seed), out)


def run(args: argparse.Namespace, out_dir: Path) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model as mlx_load

    from kdaserve import LLM, SamplingParams

    write_checkpoint(out_dir, args.seed)
    ours = load_model(out_dir, progress=False)
    ref, _ = mlx_load(out_dir)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, 4000, (args.batch, args.seq_len), generator=g)
    mids = mx.array(ids.numpy())
    with torch.inference_mode():
        got = ours.forward_dense(ids)[:, -1].numpy()
    want = np.array(ref(mids)[:, -1].astype(mx.float32))
    t_ours = t_mlx = float("inf")
    for _ in range(args.repeat):
        start = time.perf_counter()
        with torch.inference_mode():
            ours.forward_dense(ids)
        t_ours = min(t_ours, time.perf_counter() - start)
        start = time.perf_counter()
        mx.eval(ref(mids))
        t_mlx = min(t_mlx, time.perf_counter() - start)
    # greedy: kdaserve's engine (cache, chunked prefill) vs mlx-lm's incremental decode
    n = args.greedy_tokens
    prompts = [ids[i, : args.seq_len // (i + 1)].tolist() for i in range(min(args.batch, 4))]
    llm = LLM(str(out_dir), max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)
    identical = all(mlx_greedy_tokens(ref, p, n) == o.outputs[0].token_ids
                    for p, o in zip(prompts, outs))
    return {"arch": "kimi_k3", "max_abs_logit_diff_vs_mlx": float(np.abs(got - want).max()),
            "max_abs_logit": float(np.abs(want).max()), "greedy_identical_vs_mlx": identical,
            "greedy_prompts": len(prompts), "greedy_tokens": n,
            "forward_s_kdaserve": round(t_ours, 4), "forward_s_mlx": round(t_mlx, 4),
            "forward_speedup_vs_mlx": round(t_mlx / t_ours, 2),
            "expert_bytes_per_weight": round(ours.weight_report()["expert_bytes_per_weight"], 4),
            "batch": args.batch, "seq_len": args.seq_len, "threads": torch.get_num_threads()}
