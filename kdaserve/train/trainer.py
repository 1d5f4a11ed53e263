"""Train a small Kimi Linear-format model with kdaserve's own modules (the ones the engine runs).

The router is balanced DeepSeek-V3 style: after each step every MoE layer's
e_score_correction_bias moves by `bias_update_rate` toward uniform load (the bias only selects
experts, so this steers routing without touching the loss).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kdaserve.model.base import HybridForCausalLM
from kdaserve.model.loader import save_model
from kdaserve.model.moe import SparseMoE
from kdaserve.model.registry import build_model, load_config
from kdaserve.model_config import ModelConfig


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    max_steps: int = 100_000
    time_budget_s: float = 35 * 60
    eval_every: int = 100
    eval_batches: int = 8
    bias_update_rate: float = 1e-3
    chunk_size: int = 16
    seed: int = 0
    threads: int | None = None


def demo_model_config(vocab_size: int, eos_id: int, pad_id: int) -> ModelConfig:
    """~13M parameters: 8 layers (6 KDA + 2 MLA, 3:1), 32 experts top-4 + a shared expert."""
    return load_config({
        "model_type": "kimi_linear",
        "vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8],
                               "num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4},
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64,
        "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "mla_use_nope": True, "num_experts": 32, "num_experts_per_token": 4,
        "num_shared_experts": 2, "moe_intermediate_size": 48, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": 2.0, "use_grouped_topk": False, "num_expert_group": 1,
        "topk_group": 1, "model_max_length": 1 << 20, "bos_token_id": None,
        "eos_token_id": eos_id, "pad_token_id": pad_id,
    })


def init_weights(model: HybridForCausalLM, seed: int) -> None:
    """Normal(0, 0.02) projections; A_log and dt_bias as fla initialises them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0, generator=g).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1), generator=g)
                dt = dt.exp().clamp_min(1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif p.dim() >= 2:
                std = 0.02
                if name.endswith(("o_proj.weight", "down_proj.weight", "experts_w2")):
                    std = 0.02 / math.sqrt(2 * model.config.num_hidden_layers)
                p.normal_(0.0, std, generator=g)
            elif name.endswith("weight"):
                p.fill_(1.0)


class AuxTask(Protocol):
    """A second objective trained in the same steps as the text (the K3 demo's images): its loss
    is added to the text loss, its parameters (heads that are not part of the model) join the
    optimiser, and `evaluate` reports on it with every held-out evaluation."""

    def parameters(self) -> list[torch.nn.Parameter]: ...

    def loss(self, model: HybridForCausalLM) -> torch.Tensor: ...

    def evaluate(self, model: HybridForCausalLM) -> dict: ...


class TokenStream:
    """Random windows of seq_len + 1 tokens from one flat token array (deterministic)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.rng = random.Random(seed)

    def batch(self, n: int) -> torch.Tensor:
        hi = len(self.tokens) - self.seq_len - 1
        starts = [self.rng.randrange(hi) for _ in range(n)]
        return torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])


def _moe_layers(model: HybridForCausalLM) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


@torch.no_grad()
def evaluate(model: HybridForCausalLM, tokens: torch.Tensor, seq_len: int,
             max_batches: int, batch_size: int) -> float:
    """Mean next-token loss over consecutive held-out windows (deterministic)."""
    model.eval()
    n = min(max_batches * batch_size, (len(tokens) - 1) // seq_len)
    losses = []
    for i in range(0, n, batch_size):
        rows = [tokens[j * seq_len: j * seq_len + seq_len + 1]
                for j in range(i, min(n, i + batch_size))]
        x = torch.stack(rows)
        logits = model.forward_dense(x[:, :-1])
        losses.append(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
    model.train()
    return float(sum(losses) / (n * seq_len))


def train(model_cfg: ModelConfig, train_tokens: torch.Tensor, eval_tokens: torch.Tensor,
          cfg: TrainConfig, out_dir: Path | None = None, log=print,
          init_from: Path | None = None, aux: AuxTask | None = None,
          init: Callable[[HybridForCausalLM, int], None] = init_weights) -> dict:
    """Train from scratch, or continue from the checkpoint at `init_from` (same config)."""
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if init_from is not None:
        from kdaserve.model.loader import load_model

        model = load_model(init_from, chunk_size=cfg.chunk_size, progress=False)
        if model.config != model_cfg:
            raise ValueError(f"{init_from} has another model config than the one to train")
    else:
        model = build_model(model_cfg, chunk_size=cfg.chunk_size)
        init(model, cfg.seed)
    model.train()
    moes = _moe_layers(model)
    for m in moes:
        m.load_counts = torch.zeros(model_cfg.num_experts)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    if aux is not None:
        no_decay += list(aux.parameters())
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    stream = TokenStream(train_tokens, cfg.seq_len, cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters; {len(train_tokens)} training tokens")
    history = []
    start = time.monotonic()
    bar = tqdm(total=int(cfg.time_budget_s), desc="Training", unit="s",
               bar_format="{l_bar}{bar}| {n:.0f}/{total}s budget{postfix}")
    step = 0
    tokens_seen = 0
    while step < cfg.max_steps and time.monotonic() - start < cfg.time_budget_s:
        lr = _lr(step, cfg, time.monotonic() - start)
        for group in opt.param_groups:
            group["lr"] = lr
        x = stream.batch(cfg.batch_size)
        logits = model.forward_dense(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        total = loss + aux.loss(model) if aux is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _balance(moes, cfg.bias_update_rate)
        step += 1
        tokens_seen += x[:, 1:].numel()
        bar.n = min(int(time.monotonic() - start), bar.total)
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}", lr=f"{lr:.1e}")
        if step % cfg.eval_every == 0:
            ev = evaluate(model, eval_tokens, cfg.seq_len, cfg.eval_batches, cfg.batch_size)
            elapsed = time.monotonic() - start
            extra = aux.evaluate(model) if aux is not None else {}
            history.append({"step": step, "train_loss": loss.item(), "eval_loss": ev,
                            "tokens": tokens_seen, "elapsed_s": round(elapsed, 1), **extra})
            log(f"step {step}: train {loss.item():.3f} eval {ev:.3f} (ppl {math.exp(ev):.1f}), "
                f"{tokens_seen / elapsed:.0f} tok/s {json.dumps(extra) if extra else ''}")
    bar.close()
    elapsed = time.monotonic() - start
    final = evaluate(model, eval_tokens, cfg.seq_len, 10_000, cfg.batch_size)
    loads = expert_load(model, eval_tokens, cfg.seq_len, cfg.batch_size)
    summary = {"steps": step, "tokens": tokens_seen, "elapsed_s": round(elapsed, 1),
               "tokens_per_s": round(tokens_seen / max(elapsed, 1e-9), 1),
               "eval_loss": final, "eval_perplexity": math.exp(final),
               "parameters": n_params, "expert_load": loads, "history": history,
               "train_config": asdict(cfg)}
    if aux is not None:
        summary["aux"] = aux.evaluate(model)
    log(f"done: {step} steps, {tokens_seen} tokens in {elapsed / 60:.1f} min; "
        f"held-out perplexity {math.exp(final):.2f}")
    for m in moes:
        m.load_counts = None
    model.eval()
    if out_dir is not None:
        save_model(model, out_dir, dtype=torch.bfloat16)
        with open(Path(out_dir) / "training_summary.json", "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return {"model": model, **summary}


def _lr(step: int, cfg: TrainConfig, elapsed: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(step / cfg.max_steps, elapsed / cfg.time_budget_s))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def _balance(moes: list[SparseMoE], rate: float) -> None:
    for m in moes:
        load = m.load_counts
        if load.sum() > 0:
            m.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        load.zero_()


@torch.no_grad()
def expert_load(model: HybridForCausalLM, tokens: torch.Tensor, seq_len: int,
                batch_size: int) -> list[dict]:
    """Per MoE layer: share of routed slots of the busiest expert and number of idle experts."""
    moes = _moe_layers(model)
    for m in moes:
        m.load_counts = torch.zeros(m.num_experts)
    evaluate(model, tokens, seq_len, 4, batch_size)
    out = []
    for i, m in enumerate(moes):
        share = m.load_counts / m.load_counts.sum().clamp_min(1)
        out.append({"moe_layer": i, "max_share": round(float(share.max()), 4),
                    "min_share": round(float(share.min()), 4),
                    "idle_experts": int((m.load_counts == 0).sum())})
        m.load_counts = None
    return out
