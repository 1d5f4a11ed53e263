"""`kdaserve extract-hidden`: the DSpark draft's training data, produced by the target itself.

Prompts are cut from a corpus and continued by the serving engine, greedily and sampled at a mix
of temperatures (top-p 0.95), because the draft must predict what the target says when users
sample from it, not the corpus text. The target's prefill over prompt + continuation then
captures, per position, the hidden states after the draft's `target_layer_ids` (the draft's
input) and the final normed hidden state (the LM head's input), from which training recomputes
the target's distribution through the shared LM head: soft targets without storing
position × vocab logits.

Shards are safetensors: input_ids [S, L] int32, hidden [S, L, n*H] bf16, final [S, L, H] bf16.
`--corpus shakespeare` uses the demo's own corpus: its held-out plays (except those the speculation
benchmark reserves as unseen text) and its training split, in the proportion `--heldout-share`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from kdaserve.model.batch import build_forward_batch

DEFAULT_TEMPERATURES = (0.0, 0.6, 0.8, 1.0)


def default_layers(num_layers: int, n: int = 3) -> tuple[int, ...]:
    """n target layers spread from shallow to the last (0-based)."""
    return tuple(sorted({round(1 + i * (num_layers - 2) / max(1, n - 1)) for i in range(n)}))


def shakespeare_texts(heldout_share: float = 0.5) -> list[tuple[str, float]]:
    """(text, weight) pairs: the demo corpus's held-out plays minus the benchmark's reserved ones,
    and its training split."""
    from kdaserve.bench.spec_prompts import RESERVED_DOCUMENTS
    from kdaserve.train.corpus import fetch_shakespeare, load_corpus, split_documents

    train, held = split_documents(load_corpus(fetch_shakespeare()), eval_fraction=0.05, seed=0)
    held = [d for d in held if d.name not in RESERVED_DOCUMENTS]
    return [("\n\n".join(d.text for d in held), heldout_share),
            ("\n\n".join(d.text for d in train), 1.0 - heldout_share)]


def _prompts(ids_by_text: list[tuple[list[int], float]], prompt_len: int, n: int,
             seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for ids, weight in ids_by_text:
        starts = list(range(0, len(ids) - prompt_len, prompt_len))
        rng.shuffle(starts)
        out += [ids[s:s + prompt_len] for s in starts[: round(n * weight)]]
    rng.shuffle(out)
    return out[:n]


def _continue(llm, prompts: list[list[int]], generate: int, temperatures: tuple[float, ...],
              top_p: float, seed: int) -> list[list[int]]:
    """Each prompt continued at one temperature of the mix (round robin), seeded per prompt."""
    from kdaserve import SamplingParams

    by_temp: dict[float, list[int]] = {}
    for i in range(len(prompts)):
        by_temp.setdefault(temperatures[i % len(temperatures)], []).append(i)
    seqs: list[list[int]] = [[] for _ in prompts]
    for t, idx in by_temp.items():
        params = [SamplingParams(temperature=t, top_p=top_p if t > 0 else 1.0,
                                 max_tokens=generate, ignore_eos=True, seed=seed + i)
                  for i in idx]
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx], params)
        for i, o in zip(idx, outs):
            seqs[i] = prompts[i] + o.outputs[0].token_ids
    return seqs


def extract_hidden(model: str, data: str | list[str] | None, out: str, *,
                   layers: tuple[int, ...] | None = None, prompt_len: int = 32,
                   generate: int = 224, max_seqs: int = 512, shard_size: int = 128,
                   batch: int = 16, seed: int = 0,
                   temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES, top_p: float = 0.95,
                   corpus: str | None = None, heldout_share: float = 0.5) -> dict:
    from kdaserve import LLM

    llm = LLM(model, max_num_seqs=64, enable_prefix_caching=False, cache_memory=512 << 20,
              max_model_len=prompt_len + generate + 8)
    target = llm.engine.model
    layers = layers or default_layers(target.config.num_hidden_layers)
    texts: list[tuple[str, float]] = []
    if corpus == "shakespeare":
        texts += shakespeare_texts(heldout_share)
    elif corpus is not None:
        raise ValueError(f"unknown corpus {corpus!r} (supported: shakespeare)")
    files = [data] if isinstance(data, str) else list(data or [])
    texts += [(Path(f).read_text(encoding="utf-8"), 1.0 / len(files)) for f in files]
    if not texts:
        raise ValueError("extract-hidden needs --data FILE or --corpus")
    total = sum(w for _, w in texts)
    enc = [(llm.tokenizer.encode(t, add_special_tokens=False), w / total) for t, w in texts]
    prompts = _prompts(enc, prompt_len, max_seqs, seed)
    seqs = _continue(llm, prompts, generate, temperatures, top_p, seed) if generate else prompts
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_shards = 0
    buf: dict[str, list[torch.Tensor]] = {"input_ids": [], "hidden": [], "final": []}
    bar = tqdm(total=len(seqs), desc="Extracting hidden states", unit="seq")
    with torch.inference_mode():
        for i in range(0, len(seqs), batch):
            chunk = torch.tensor(seqs[i:i + batch])
            b, n = chunk.shape
            fb = build_forward_batch([n] * b, conv_kernel=target.config.conv_kernel_size,
                                     chunk_size=target.chunk_size)
            x, captured = target.run_layers(target.model.embed_tokens(chunk.reshape(-1)), fb,
                                            layers)
            buf["input_ids"].append(chunk.to(torch.int32))
            buf["hidden"].append(torch.cat(captured, -1).view(b, n, -1).to(torch.bfloat16))
            buf["final"].append(target.model.norm(x).view(b, n, -1).to(torch.bfloat16))
            bar.update(b)
            if sum(x.shape[0] for x in buf["input_ids"]) >= shard_size or i + batch >= len(seqs):
                save_file({k: torch.cat(v) for k, v in buf.items()},
                          str(out_dir / f"shard-{n_shards:05d}.safetensors"))
                n_shards += 1
                buf = {k: [] for k in buf}
    bar.close()
    meta = {"target_layer_ids": list(layers), "hidden_size": target.config.hidden_size,
            "num_sequences": len(seqs), "sequence_length": len(seqs[0]) if seqs else 0,
            "prompt_len": prompt_len, "generated": generate, "shards": n_shards,
            "temperatures": list(temperatures) if generate else [], "top_p": top_p,
            "corpus": corpus, "data": files, "heldout_share": heldout_share if corpus else None}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def add_extract_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target model directory (default: the demo)")
    p.add_argument("--data", action="append", default=[],
                   help="UTF-8 text file to cut prompts from (repeatable)")
    p.add_argument("--corpus", choices=("shakespeare",), default=None,
                   help="the demo corpus: held-out plays (minus the bench's) and training split")
    p.add_argument("--heldout-share", type=float, default=0.5,
                   help="with --corpus: share of prompts cut from the held-out plays")
    p.add_argument("--out", required=True, help="directory for the safetensors shards")
    p.add_argument("--layers", default=None,
                   help="comma-separated 0-based target layers (default: 3 spread to the last)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--generate", type=int, default=224,
                   help="tokens the target generates after each prompt (0: corpus text only)")
    p.add_argument("--temperatures", default=",".join(str(t) for t in DEFAULT_TEMPERATURES),
                   help="continuations are generated at these temperatures in turn (0: greedy)")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-seqs", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)


def run_extract(args: argparse.Namespace) -> int:
    from kdaserve.assets import default_model_path

    layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
    meta = extract_hidden(args.model or str(default_model_path()), args.data, args.out,
                          layers=layers, prompt_len=args.prompt_len, generate=args.generate,
                          max_seqs=args.max_seqs, seed=args.seed, corpus=args.corpus,
                          temperatures=tuple(float(t) for t in args.temperatures.split(",")),
                          top_p=args.top_p, heldout_share=args.heldout_share)
    print(json.dumps(meta))
    return 0
