"""`kdaserve bench disagg`'s second-turn scenarios: the decode side's prefix-hit savings.

A multi-turn chat, on a prefill + decode pair with prefix caching on both sides: the first
turn's prompts (lengths drawn from [chat_len / 2, chat_len]) run all at once, then their
follow-ups, all at once. Two scenarios:
- `follow_up`: each follow-up is its conversation so far, the first prompt and its generated
  answer, then a new user turn. The decode instance holds that prefix (the blocks it wrote and
  the KDA snapshot it took while decoding the answer) and says so to the hit query, so the
  prefill instance sends only the rest and the decode instance shares those blocks
  (kdaserve/disagg/handoff.py, transfer.py). The prefill instance holds the first prompt and
  computes from its last snapshot in it;
- `fresh`: follow-ups of the same lengths that share nothing with the first turn: no hits
  on either side (the control).
The same follow-ups also run on the bench's pair without prefix caching (the mixed load's),
for the bytes and the transfer time without the hits. The savings: the held tokens' latents
neither cross the wire nor are written into the decode side's cache. The KDA states always
travel and are always installed (the transfer's state, taken at the end of the prompt,
replaces the hit's snapshot): their skipped bytes are 0."""

from __future__ import annotations

import torch

from kdaserve.bench.disagg_pair import Pair
from kdaserve.disagg.local import Trace, run_colocated
from kdaserve.engine.core import EngineCore
from kdaserve.request import SamplingParams

SCENARIOS = ("follow_up", "fresh")


def per_request(moved: dict[str, float]) -> dict[str, int]:
    """Bytes sent per request, MLA latents and KDA states."""
    n = max(1.0, moved["sent"])
    return {"mla": int(moved["sent_mla_bytes"] // n), "kda": int(moved["sent_kda_bytes"] // n)}


def _seconds(moved: dict[str, float]) -> dict[str, float]:
    """Per request: the pushes' host copies (on the prefill engine thread while later chunks
    compute), the last part until every acknowledgement (prefill side) and installing the
    transfer into the cache (decode side); the last two are what the request waits for
    after its prompt's last chunk (`wait_s`)."""
    n = max(1.0, moved["sent"])
    push, send = moved["push_seconds"] / n, moved["send_seconds"] / n
    receive = moved["decode_receive_seconds"] / n
    return {"push_s": round(push, 6), "send_s": round(send, 6),
            "receive_s": round(receive, 6), "wait_s": round(send + receive, 6)}


def _errors(traces: list[Trace]) -> list[str]:
    return [t.error for t in traces if t.error]


def scenario(name: str, cached: Pair, plain: Pair, colo: EngineCore, first: list[list[int]],
             turn_len: int, params: SamplingParams, g: torch.Generator, vocab: int,
             latent_bytes: int, decode_block: int) -> dict:
    """One scenario's two turns on `cached` (prefix caching on both sides), the follow-ups
    again on `plain` (off); `latent_bytes`: MLA latent bytes per token, all layers."""
    ref1 = run_colocated(colo, first, params)
    t1, m1 = cached.run(first, params)
    if name == "follow_up":
        second = [p + t.tokens + torch.randint(3, vocab, (turn_len,), generator=g).tolist()
                  for p, t in zip(first, t1)]
    else:
        lens = [len(p) + len(t.tokens) + turn_len for p, t in zip(first, t1)]
        second = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    ref2 = run_colocated(colo, second, params)
    t2, m2 = cached.run(second, params)
    t2n, m2n = plain.run(second, params)
    n = max(1.0, m2["sent"])
    hit = int(m2["decode_hit_tokens"])
    errors = _errors(ref1 + t1 + ref2 + t2 + t2n)
    want1, want2 = [t.tokens for t in ref1], [t.tokens for t in ref2]
    same1 = [t.tokens for t in t1] == want1
    same2 = [t.tokens for t in t2] == want2 and [t.tokens for t in t2n] == want2
    mla = m2["sent_mla_bytes"]
    saved = m2n["sent_mla_bytes"] - mla
    return {
        "requests": len(first),
        "turn1_tokens": {"min": min(map(len, first)), "max": max(map(len, first))},
        "turn2_tokens": {"min": min(map(len, second)), "max": max(map(len, second))},
        "identical": not errors and same1 and same2,
        "identical_turn2": not errors and same2,
        "errors": errors,
        "turn1": {"bytes_per_request": per_request(m1),
                  "prefill_prefix_hit_tokens": int(m1["hit_tokens"]),
                  "decode_prefix_hit_tokens": int(m1["decode_hit_tokens"])},
        "turn2": {"bytes_per_request": per_request(m2),
                  "prefill_prefix_hit_tokens": int(m2["hit_tokens"]),
                  "decode_prefix_hit_tokens": hit},
        # what the decode side held (the hit query): neither sent nor written into its cache
        "decode_skipped": {
            "tokens": hit, "blocks": hit // decode_block, "mla_bytes": hit * latent_bytes,
            "kda_bytes": 0,
            "per_request": {"tokens": round(hit / n, 1), "blocks": round(hit / decode_block / n, 2),
                            "mla_bytes": int(hit * latent_bytes // n)},
            "frac_of_prompt_mla_bytes": (round(hit * latent_bytes / (mla + hit * latent_bytes), 4)
                                         if mla else 0.0),
        },
        # the bytes that crossed the wire in the second turn, all requests: with the hits (the
        # hit query on this pair) and without them (the same follow-ups on the pair without
        # prefix caching: the whole prompts)
        "wire_bytes": {
            "with_hits": {"mla": int(mla), "kda": int(m2["sent_kda_bytes"])},
            "without_hits": {"mla": int(m2n["sent_mla_bytes"]),
                             "kda": int(m2n["sent_kda_bytes"])},
            "saved": int(saved),
            "saved_frac": round(saved / (m2n["sent_mla_bytes"] + m2n["sent_kda_bytes"]), 4)
            if m2n["sent"] else 0.0,
        },
        "transfer_per_request": {
            "with_hits": {**_seconds(m2), "bytes_per_request": per_request(m2)},
            "without_hits": {**_seconds(m2n), "bytes_per_request": per_request(m2n),
                             "decode_prefix_hit_tokens": int(m2n["decode_hit_tokens"])},
        },
    }


def measure_turns(model: str, plain: Pair, colo: EngineCore, pre_args: dict, dec_args: dict,
                  num_chats: int, chat_len: int, turn_len: int,
                  params: SamplingParams, seed: int, latent_bytes: int, decode_block: int,
                  prefill_cpus: set[int] | None) -> dict:
    """Both scenarios on a fresh pair with prefix caching on both sides (`pre_args` and
    `dec_args` as the plain pair's, caching aside)."""
    cached = Pair(model, {**pre_args, "enable_prefix_caching": True},
                  {**dec_args, "enable_prefix_caching": True}, prefill_cpus)
    vocab = colo.model_config.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    try:
        cached.run([[5, 6, 7]], params)                                # warm-up
        out = {}
        for name in SCENARIOS:
            # lengths spread as a chat's are: the decode side snapshots the KDA state at the
            # first block boundary its answer crosses, which a prompt ending on one may not
            lens = torch.randint(chat_len // 2, chat_len + 1, (num_chats,), generator=g)
            first = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lens]
            out[name] = scenario(name, cached, plain, colo, first, turn_len, params, g, vocab,
                                 latent_bytes, decode_block)
    finally:
        cached.close()
    return {"prefix_caching": {"prefill": True, "decode": True}, "chats": num_chats,
            "chat_len": chat_len, "turn_len": turn_len, **out}
