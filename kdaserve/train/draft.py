"""`kdaserve train-draft`: the DSpark draft distilled from the target's distributions.

The data comes from `kdaserve extract-hidden` (train/draft_data.py): sequences the target itself
continued, greedily and sampled, with the hidden states the draft reads and the target's final
hidden states. The target stays frozen; its embedding and LM head are shared. Each step takes
random block anchors per sequence: a block's k queries (anchor token + k-1 masks) see the context
before the anchor and predict the k tokens after it (the Markov bias teacher-forced on the true
previous token, which is what the verifier conditions on once that token is accepted).

The loss is distillation, not next-token cross-entropy: at every query position the target's
distribution p = softmax(lm_head(final) / T) is recomputed from the stored final hidden state, and
the draft's q = softmax(z / T) is fitted to it by KL(p || q), averaged over a mix of temperatures
(low ones weigh the argmax, what greedy verification accepts; 0.8-1.0 weigh the body of the
distribution, what sampled verification accepts: a draft is kept with probability Σ min(p, q)).
Held-out figures: greedy agreement (argmax q = argmax p) and, at the serving temperature, the
expected sampled acceptance Σ min(p, q), each as mean accepted drafts per block.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm

from kdaserve.model.dspark import DraftConfig, training_mask
from kdaserve.model.loader import load_model
from kdaserve.model.registry import build_draft

DEFAULT_TEMPERATURES = (0.3, 0.8, 1.0)


def _load_shards(hidden_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    meta = json.loads((hidden_dir / "meta.json").read_text())
    parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "hidden": [], "final": []}
    for f in sorted(hidden_dir.glob("shard-*.safetensors")):
        t = load_file(str(f))
        if "final" not in t:
            raise ValueError(f"{f} has no final hidden states (written by an older "
                             "extract-hidden): extract again")
        for k in parts:
            parts[k].append(t[k])
    if not parts["input_ids"]:
        raise FileNotFoundError(f"no shard-*.safetensors in {hidden_dir}")
    data = {k: torch.cat(v) for k, v in parts.items()}
    data["input_ids"] = data["input_ids"].long()
    return data, meta


@dataclass
class BlockLogits:
    """One batch of blocks: the draft's logits z_d and the target's z_t, [B, A*k, V]."""

    draft: torch.Tensor
    target: torch.Tensor
    block: int


def _block_logits(draft: nn.Module, embed, lm_head, data: dict[str, torch.Tensor],
                  anchors: torch.Tensor, k: int,
                  temperatures: torch.Tensor | None = None) -> BlockLogits:
    ids, hidden, final = data["input_ids"], data["hidden"], data["final"]
    b, n = ids.shape
    pos = torch.arange(n).expand(b, n)
    lat = draft.context_latents(hidden.reshape(b * n, -1).float(), pos.reshape(-1))
    ctx = [x.view(b, n, -1) for x in lat]
    q_pos = (anchors[..., None] + torch.arange(k)).reshape(b, -1)              # [B,A*k]
    first = embed(ids.gather(1, anchors))                                      # [B,A,H]
    h = draft.block_hidden(first, q_pos, ctx, training_mask(n, anchors, k), k,
                           temperatures)                                        # [B,A*k,H]
    prev = ids.gather(1, q_pos)                                                # teacher-forced
    z_d = lm_head(h).float() + draft.markov_bias(prev).float()
    with torch.no_grad():
        f = final.gather(1, q_pos[..., None].expand(-1, -1, final.shape[-1]))
        z_t = lm_head(f.to(lm_head.weight.dtype)).float()
    return BlockLogits(z_d, z_t, k)


def distill_loss(z: BlockLogits, temperatures: tuple[float, ...]) -> torch.Tensor:
    """Mean over temperatures of KL(softmax(z_t/T) || softmax(z_d/T)) per position."""
    rows = z.draft.shape[0]
    return sum(conditioned_loss(z, z.draft.new_full((rows,), t))
               for t in temperatures) / len(temperatures)


def conditioned_loss(z: BlockLogits, row_temps: torch.Tensor) -> torch.Tensor:
    """Mean of KL(softmax(z_t/T_b) || softmax(z_d/T_b)), each row b at its own temperature."""
    t = row_temps.to(z.draft)[:, None, None]
    logp = F.log_softmax(z.target / t, -1)
    logq = F.log_softmax(z.draft / t, -1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


@torch.no_grad()
def block_acceptance(z: BlockLogits, temperature: float) -> dict[str, float]:
    """Held-out acceptance per block: greedy (argmax agreement up to the first miss) and
    sampled at `temperature` (a draft stands with probability Σ min(p, q); expected leading
    accepted drafts Σ_j Π_{i≤j} α_i)."""
    hits = (z.draft.argmax(-1) == z.target.argmax(-1)).view(*z.draft.shape[:1], -1, z.block)
    alpha = torch.minimum(F.softmax(z.target / temperature, -1),
                          F.softmax(z.draft / temperature, -1)).sum(-1)
    alpha = alpha.view(*z.draft.shape[:1], -1, z.block)
    greedy = hits.float().cumprod(-1).sum(-1).mean()
    sampled = alpha.cumprod(-1).sum(-1).mean()
    return {"mean_accepted": float(greedy), "acceptance_rate": float(greedy / z.block),
            "sampled_mean_accepted": float(sampled),
            "sampled_acceptance_rate": float(sampled / z.block),
            "sampled_first_draft": float(alpha[..., 0].mean())}


def _generation_temperatures(meta: dict, total: int) -> torch.Tensor:
    """[total] the temperature each sequence was continued at (extract-hidden's round robin)."""
    temps = meta.get("temperatures") or []
    if not meta.get("generated") or not temps:
        raise ValueError("temperature conditioning needs continuations the target wrote at "
                         "known temperatures (extract-hidden --generate N --temperatures ...)")
    return torch.tensor([float(temps[i % len(temps)]) for i in range(total)])


def _slice(data: dict[str, torch.Tensor], idx) -> dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in data.items()}


def train_draft(model: str, hidden: str, out: str, *, steps: int = 2000, batch: int = 8,
                anchors: int = 16, block: int = 8, lr: float = 2e-3, num_layers: int = 1,
                heldout: float = 0.05, seed: int = 0, device: str = "cpu",
                temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES,
                serving_temperature: float = 0.8, condition_temperature: bool = False) -> dict:
    torch.manual_seed(seed)
    target = load_model(model, dtype="float32", device=device)
    for p in target.parameters():
        p.requires_grad_(False)
    data, meta = _load_shards(Path(hidden))
    tc = target.config
    n = data["input_ids"].shape[1]          # the training sequences' length
    cfg = DraftConfig(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                      target_layer_ids=tuple(meta["target_layer_ids"]),
                      num_hidden_layers=num_layers,
                      num_attention_heads=tc.num_attention_heads, kv_lora_rank=tc.kv_lora_rank,
                      qk_nope_head_dim=tc.qk_nope_head_dim, qk_rope_head_dim=tc.qk_rope_head_dim,
                      v_head_dim=tc.v_head_dim, intermediate_size=2 * tc.hidden_size,
                      block_size=block, rope_theta=tc.rope_theta, rms_norm_eps=tc.rms_norm_eps,
                      temperature_conditioning=condition_temperature,
                      max_conditioning_temperature=max(meta.get("temperatures") or [1.0]),
                      # no query meets a key farther back than the training sequences are
                      # long: past that, acceptance fell to 1.6-2.1 tokens a block on 1k-4k
                      # inputs (docs/speculation-sampling.md, "The draft's context window")
                      context_window=int(n))
    draft = build_draft(cfg).to(device)
    total = len(data["input_ids"])
    if condition_temperature:
        data["gen_t"] = _generation_temperatures(meta, total)
    n_eval = max(1, int(total * heldout))
    ev, tr = _slice(data, slice(0, n_eval)), _slice(data, slice(n_eval, total))
    lo = meta.get("prompt_len", 1) if meta.get("generated") else 1
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / steps)))
    embed, lm_head = target.model.embed_tokens, target.lm_head
    g = torch.Generator().manual_seed(seed)
    bar = tqdm(range(steps), desc="Training draft", unit="step")
    loss = torch.zeros(())
    for step in bar:
        pick = torch.randint(0, total - n_eval, (batch,), generator=g)
        anc = torch.randint(max(1, lo - 1), n - block - 1, (batch, anchors), generator=g)
        rows = _slice(tr, pick)
        if condition_temperature:
            # each sequence at the temperature it was written at (greedy ones at the lowest)
            t = rows["gen_t"]
            z = _block_logits(draft, embed, lm_head, rows, anc, block, t)
            loss = conditioned_loss(z, torch.where(t > 0, t, min(temperatures)))
        else:
            z = _block_logits(draft, embed, lm_head, rows, anc, block)
            loss = distill_loss(z, temperatures)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0:
            acc = block_acceptance(z, serving_temperature)
            bar.set_postfix(loss=f"{loss.item():.3f}", greedy=f"{acc['mean_accepted']:.2f}",
                            sampled=f"{acc['sampled_mean_accepted']:.2f}")
    bar.close()
    draft.eval()
    ev_report = _evaluate(draft, embed, lm_head, ev, n, lo, anchors, block, temperatures,
                          serving_temperature, seed + 1)
    draft.save_pretrained(out)
    report = {"steps": steps, "train_loss": loss.item(), "loss": "kl_distillation",
              "temperature_conditioning": condition_temperature,
              "temperatures": list(temperatures), "serving_temperature": serving_temperature,
              **{f"heldout_{k}": v for k, v in ev_report.items()},
              "block_size": block, "target_layer_ids": list(cfg.target_layer_ids),
              "parameters": sum(p.numel() for p in draft.parameters()),
              "data": {k: meta.get(k) for k in ("num_sequences", "sequence_length",
                                                 "temperatures", "top_p", "corpus")}}
    (Path(out) / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


@torch.no_grad()
def _evaluate(draft, embed, lm_head, ev: dict[str, torch.Tensor], n: int, lo: int, anchors: int,
              block: int, temperatures: tuple[float, ...], serving_temperature: float,
              seed: int, chunk: int = 8) -> dict[str, float]:
    ge = torch.Generator().manual_seed(seed)
    num = len(ev["input_ids"])
    anc = torch.randint(max(1, lo - 1), n - block - 1, (num, anchors), generator=ge)
    sums: dict[str, float] = {}
    conditioned = draft.config.temperature_conditioning
    for i in range(0, num, chunk):
        part, a = _slice(ev, slice(i, i + chunk)), anc[i:i + chunk]
        b = len(part["input_ids"])
        # a conditioned draft is asked as it is served: greedy at T 0, sampled at the serving T
        z = _block_logits(draft, embed, lm_head, part, a, block,
                          torch.full((b,), serving_temperature) if conditioned else None)
        acc = block_acceptance(z, serving_temperature)
        if conditioned:
            zg = block_acceptance(_block_logits(draft, embed, lm_head, part, a, block,
                                                torch.zeros(b)), serving_temperature)
            acc.update(mean_accepted=zg["mean_accepted"], acceptance_rate=zg["acceptance_rate"])
        w = b / num
        for k, v in {"loss": float(distill_loss(z, temperatures)), **acc}.items():
            sums[k] = sums.get(k, 0.0) + v * w
    return sums


# ---- CLI ----------------------------------------------------------------------------------------
def add_train_draft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target model directory (default: the demo)")
    p.add_argument("--hidden", required=True, help="directory written by extract-hidden")
    p.add_argument("--out", required=True, help="directory for the draft checkpoint")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block-size", type=int, default=8, help="query positions per draft block")
    p.add_argument("--layers", type=int, default=1, help="draft decoder layers")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--temperatures", default=",".join(str(t) for t in DEFAULT_TEMPERATURES),
                   help="distillation temperatures (the KL loss is averaged over them)")
    p.add_argument("--serving-temperature", type=float, default=0.8,
                   help="temperature of the held-out sampled-acceptance estimate")
    p.add_argument("--temperature-conditioning", action="store_true",
                   help="the draft reads the request's temperature: each sequence is "
                        "distilled at the temperature it was written at (greedy ones at the "
                        "lowest of --temperatures)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def run_train_draft(args: argparse.Namespace) -> int:
    from kdaserve.assets import default_model_path

    report = train_draft(args.model or str(default_model_path()), args.hidden, args.out,
                         steps=args.steps, batch=args.batch, block=args.block_size,
                         num_layers=args.layers, lr=args.lr, device=args.device,
                         temperatures=tuple(float(t) for t in args.temperatures.split(",")),
                         serving_temperature=args.serving_temperature,
                         condition_temperature=args.temperature_conditioning)
    print(json.dumps(report))
    return 0
