"""`kdaserve bench reference`: kdaserve's model vs independent implementations, in one run.

Needs the test extras. `--arch kimi_linear` (default; transformers, fla-core) reports the max abs
logit difference against transformers' KimiLinearForCausalLM on the same random checkpoint, the
KDA op's max error against fla-core's naive recurrence, and the time of one full-sequence
forward, both sides.
`--arch kimi_k3` compares with mlx-lm's kimi_k3 (see bench/reference_k3.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kdaserve.model.loader import load_model
from kdaserve.ops.kda import kda_chunk


def _hf_model(out: Path, seed: int):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
        q_lora_rank=None, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
        num_local_experts=32, num_experts_per_tok=4, n_shared_experts=1,
        linear_attn_config={"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8],
                            "num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4},
        first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    model.save_pretrained(out)
    return model


def _fla_error(seed: int) -> float | None:
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    ms = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(ms)
    ms.loader.exec_module(mod)
    g = torch.Generator().manual_seed(seed)
    B, T, H, K = 2, 256, 4, 64
    q = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, K, generator=g)
    gg = -torch.rand(B, T, H, K, generator=g) * 4
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, K, K, generator=g)
    ref_o, ref_s = mod.naive_recurrent_kda(q, k, v, gg, beta, scale=1.0, initial_state=s0,
                                           output_final_state=True)
    o, s, _ = kda_chunk(q, k, v, gg, beta, s0, 16)
    return max(float((o - ref_o).abs().max()), float((s - ref_s).abs().max()))


def _time(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--arch", choices=["kimi_linear", "kimi_k3"], default="kimi_linear",
                   help="kimi_linear: vs transformers + fla-core; kimi_k3: vs mlx-lm")
    p.add_argument("--greedy-tokens", type=int, default=32,
                   help="kimi_k3: greedy tokens compared per prompt")


def run(args: argparse.Namespace) -> int:
    if args.arch == "kimi_k3":
        from kdaserve.bench.reference_k3 import run as run_k3

        with tempfile.TemporaryDirectory() as d:
            result = run_k3(args, Path(d))
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    with tempfile.TemporaryDirectory() as d:
        hf = _hf_model(Path(d), args.seed)
        ours = load_model(d, progress=False)
    ids = torch.randint(3, 4096, (args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(args.seed))
    with torch.inference_mode():
        ref = hf(ids).logits
        got = ours.forward_dense(ids)
        t_hf = _time(lambda: hf(ids), args.repeat)
        t_ours = _time(lambda: ours.forward_dense(ids), args.repeat)
    result = {"max_abs_logit_diff": float((ref - got).abs().max()),
              "max_abs_logit": float(ref.abs().max()),
              "kda_op_max_err_vs_fla_naive": _fla_error(args.seed),
              "forward_s_kdaserve": round(t_ours, 4), "forward_s_transformers": round(t_hf, 4),
              "forward_speedup_vs_transformers": round(t_hf / t_ours, 2),
              "batch": args.batch, "seq_len": args.seq_len, "threads": torch.get_num_threads()}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
