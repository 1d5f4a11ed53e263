"""`kdaserve extract-hidden` and `kdaserve train-draft`: the DSpark draft's training loop.

extract-hidden runs the serving engine over a corpus: prompts cut from the text are continued
greedily by the target (the draft must predict what the target says, not the corpus), then the
target's prefill over prompt + continuation captures the hidden states after the draft's
`target_layer_ids`. Shards are safetensors: input_ids [S, L] int32, hidden [S, L, n*H] bf16.

train-draft fits the draft on those shards with the target frozen (its embedding and LM head are
shared): random block anchors per sequence, a block's k queries (anchor token + k-1 masks) see
the context before the anchor, and predict the k tokens after it (the Markov bias teacher-forced
on the true previous token). A held-out split reports the acceptance a greedy verifier would
give: mean accepted drafts per block, and per-draft acceptance.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from kdaserve.model.batch import build_forward_batch
from kdaserve.model.dspark import DraftConfig, training_mask
from kdaserve.model.loader import load_model
from kdaserve.model.registry import build_draft


def default_layers(num_layers: int, n: int = 3) -> tuple[int, ...]:
    """n target layers spread from shallow to the last (0-based)."""
    return tuple(sorted({round(1 + i * (num_layers - 2) / max(1, n - 1)) for i in range(n)}))


# ---- extraction ---------------------------------------------------------------------------------
def extract_hidden(model: str, data: str, out: str, *, layers: tuple[int, ...] | None = None,
                   prompt_len: int = 32, generate: int = 224, max_seqs: int = 512,
                   shard_size: int = 128, batch: int = 16, seed: int = 0) -> dict:
    from kdaserve import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=64, enable_prefix_caching=False, cache_memory=512 << 20,
              max_model_len=prompt_len + generate + 8)
    target = llm.engine.model
    layers = layers or default_layers(target.config.num_hidden_layers)
    ids = llm.tokenizer.encode(Path(data).read_text(encoding="utf-8"), add_special_tokens=False)
    starts = list(range(0, len(ids) - prompt_len, prompt_len))
    random.Random(seed).shuffle(starts)
    prompts = [ids[s:s + prompt_len] for s in starts[:max_seqs]]
    if generate:
        sp = SamplingParams(temperature=0.0, max_tokens=generate, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    else:
        seqs = prompts
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_shards = 0
    buf_ids, buf_h = [], []
    bar = tqdm(total=len(seqs), desc="Extracting hidden states", unit="seq")
    with torch.inference_mode():
        for i in range(0, len(seqs), batch):
            chunk = torch.tensor(seqs[i:i + batch])
            b, n = chunk.shape
            fb = build_forward_batch([n] * b, conv_kernel=target.config.conv_kernel_size,
                                     chunk_size=target.chunk_size, logits_indices=[0])
            _, captured = target(chunk.reshape(-1), fb, capture_layers=layers)
            buf_ids.append(chunk.to(torch.int32))
            buf_h.append(torch.cat(captured, -1).view(b, n, -1).to(torch.bfloat16))
            bar.update(b)
            if sum(x.shape[0] for x in buf_ids) >= shard_size or i + batch >= len(seqs):
                save_file({"input_ids": torch.cat(buf_ids), "hidden": torch.cat(buf_h)},
                          str(out_dir / f"shard-{n_shards:05d}.safetensors"))
                n_shards += 1
                buf_ids, buf_h = [], []
    bar.close()
    meta = {"target_layer_ids": list(layers), "hidden_size": target.config.hidden_size,
            "num_sequences": len(seqs), "sequence_length": len(seqs[0]) if seqs else 0,
            "prompt_len": prompt_len, "generated": generate, "shards": n_shards}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# ---- training -----------------------------------------------------------------------------------
def _load_shards(hidden_dir: Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    meta = json.loads((hidden_dir / "meta.json").read_text())
    ids, hid = [], []
    for f in sorted(hidden_dir.glob("shard-*.safetensors")):
        t = load_file(str(f))
        ids.append(t["input_ids"].long())
        hid.append(t["hidden"])
    if not ids:
        raise FileNotFoundError(f"no shard-*.safetensors in {hidden_dir}")
    return torch.cat(ids), torch.cat(hid), meta


def _block_loss(draft: nn.Module, embed, lm_head, ids: torch.Tensor, hidden: torch.Tensor,
                anchors: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the k drafts after each anchor; also the logits' argmax hits [B,A,k]."""
    b, n = ids.shape
    pos = torch.arange(n).expand(b, n)
    lat = draft.context_latents(hidden.reshape(b * n, -1).float(), pos.reshape(-1))
    ctx = [x.view(b, n, -1) for x in lat]
    offs = torch.arange(k)
    q_pos = (anchors[..., None] + offs).reshape(b, -1)                     # [B,A*k]
    first = embed(ids.gather(1, anchors))                                  # [B,A,H]
    mask = training_mask(n, anchors, k)
    h = draft.block_hidden(first, q_pos, ctx, mask, k)                    # [B,A*k,H]
    target = ids.gather(1, q_pos + 1)                                      # next tokens
    prev = ids.gather(1, q_pos)                                            # teacher-forced
    logits = lm_head(h).float() + draft.markov_bias(prev).float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return loss, (logits.argmax(-1) == target).view(b, -1, k)


def acceptance(hits: torch.Tensor) -> tuple[float, float]:
    """hits [..., k] -> (mean leading accepted drafts per block, accepted / proposed)."""
    lead = hits.long().cumprod(-1).sum(-1).float()
    return float(lead.mean()), float(lead.mean() / hits.shape[-1])


def train_draft(model: str, hidden: str, out: str, *, steps: int = 2000, batch: int = 8,
                anchors: int = 16, block: int = 8, lr: float = 2e-3, num_layers: int = 1,
                heldout: float = 0.05, seed: int = 0, device: str = "cpu") -> dict:
    torch.manual_seed(seed)
    target = load_model(model, dtype="float32", device=device)
    for p in target.parameters():
        p.requires_grad_(False)
    ids, hid, meta = _load_shards(Path(hidden))
    tc = target.config
    cfg = DraftConfig(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                      target_layer_ids=tuple(meta["target_layer_ids"]), num_hidden_layers=num_layers,
                      num_attention_heads=tc.num_attention_heads, kv_lora_rank=tc.kv_lora_rank,
                      qk_nope_head_dim=tc.qk_nope_head_dim, qk_rope_head_dim=tc.qk_rope_head_dim,
                      v_head_dim=tc.v_head_dim, intermediate_size=2 * tc.hidden_size,
                      block_size=block, rope_theta=tc.rope_theta, rms_norm_eps=tc.rms_norm_eps)
    draft = build_draft(cfg).to(device)
    n_eval = max(1, int(len(ids) * heldout))
    ev_ids, ev_hid, tr_ids, tr_hid = ids[:n_eval], hid[:n_eval], ids[n_eval:], hid[n_eval:]
    n = ids.shape[1]
    lo = meta.get("prompt_len", 1) if meta.get("generated") else 1
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    embed, lm_head = target.model.embed_tokens, target.lm_head
    g = torch.Generator().manual_seed(seed)
    bar = tqdm(range(steps), desc="Training draft", unit="step")
    for step in bar:
        pick = torch.randint(0, len(tr_ids), (batch,), generator=g)
        anc = torch.randint(max(1, lo - 1), n - block - 1, (batch, anchors), generator=g)
        loss, hits = _block_loss(draft, embed, lm_head, tr_ids[pick], tr_hid[pick], anc, block)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", acc_len=f"{acceptance(hits)[0]:.2f}")
    bar.close()
    draft.eval()
    with torch.no_grad():
        ge = torch.Generator().manual_seed(seed + 1)
        anc = torch.randint(max(1, lo - 1), n - block - 1, (len(ev_ids), anchors), generator=ge)
        ev_loss, ev_hits = _block_loss(draft, embed, lm_head, ev_ids, ev_hid, anc, block)
    mean_acc, rate = acceptance(ev_hits)
    draft.save_pretrained(out)
    report = {"steps": steps, "train_loss": loss.item(), "heldout_loss": ev_loss.item(),
              "heldout_mean_accepted": mean_acc, "heldout_acceptance_rate": rate,
              "block_size": block, "target_layer_ids": list(cfg.target_layer_ids),
              "parameters": sum(p.numel() for p in draft.parameters())}
    (Path(out) / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


# ---- CLI ----------------------------------------------------------------------------------------
def add_extract_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target model directory (default: the demo)")
    p.add_argument("--data", required=True, help="UTF-8 text file to cut prompts from")
    p.add_argument("--out", required=True, help="directory for the safetensors shards")
    p.add_argument("--layers", default=None,
                   help="comma-separated 0-based target layers (default: 3 spread to the last)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--generate", type=int, default=224,
                   help="tokens the target generates after each prompt (0: corpus text only)")
    p.add_argument("--max-seqs", type=int, default=512)


def run_extract(args: argparse.Namespace) -> int:
    from kdaserve.assets import default_model_path

    layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
    meta = extract_hidden(args.model or str(default_model_path()), args.data, args.out,
                          layers=layers, prompt_len=args.prompt_len, generate=args.generate,
                          max_seqs=args.max_seqs)
    print(json.dumps(meta))
    return 0


def add_train_draft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target model directory (default: the demo)")
    p.add_argument("--hidden", required=True, help="directory written by extract-hidden")
    p.add_argument("--out", required=True, help="directory for the draft checkpoint")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block-size", type=int, default=8, help="query positions per draft block")
    p.add_argument("--layers", type=int, default=1, help="draft decoder layers")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def run_train_draft(args: argparse.Namespace) -> int:
    from kdaserve.assets import default_model_path

    report = train_draft(args.model or str(default_model_path()), args.hidden, args.out,
                         steps=args.steps, batch=args.batch, block=args.block_size,
                         num_layers=args.layers, lr=args.lr, device=args.device)
    print(json.dumps(report))
    return 0
