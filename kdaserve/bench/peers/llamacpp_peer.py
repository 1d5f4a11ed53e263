"""The llama.cpp side of `kdaserve bench compare`: runs inside the peer's own virtualenv
(llama-cpp-python, numpy; nothing of kdaserve), drives llama.cpp through the binding's
low-level API (llama_decode on explicit batches: no sampler chain, no Python per-token objects
beyond an argmax over the logits row), and answers one JSON line per command read on stdin:

    {"op": "single", "prompt": [...], "out": 256}        -> seconds, tokens
    {"op": "batch", "prompts": [[...], ...], "out": 128} -> seconds, output_tokens, tokens
    {"op": "prefill", "prompt": [...]}                   -> seconds
    {"op": "sampling", "temperature": 0.8, "top_p": 0.95, "seed": 0}: later tokens are drawn
        by llama.cpp's own sampler chain (top-p, temperature, dist), one per sequence, as
        llama-server does ({"temperature": 0}: back to greedy)

The batch workload is continuous batching as llama-server --parallel N --cont-batching does it:
every step decodes one token of each live sequence in one llama_decode (sequence ids 0..N-1);
prompts are prefilled n_batch tokens at a time across sequences first.
Usage: python llamacpp_peer.py MODEL.gguf THREADS MAX_SEQS CTX_PER_SEQ
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp as L
import numpy as np


class Peer:
    def __init__(self, model_path: str, threads: int, max_seqs: int, n_ctx: int) -> None:
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(model_path.encode(), mp)
        if not self.model:
            raise SystemExit(f"cannot load {model_path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx * max_seqs          # n_ctx tokens for each sequence
        cp.kv_unified = False
        cp.n_batch = cp.n_ubatch = 2048
        cp.n_seq_max = max_seqs
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit("cannot create a llama.cpp context")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = 2048
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.n_seq = max_seqs
        self.samplers: list | None = None       # None: greedy

    def clear(self) -> None:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        b.n_tokens = len(items)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def sampling(self, temperature: float, top_p: float = 1.0, seed: int = 0) -> dict:
        for smp in self.samplers or []:
            L.llama_sampler_free(smp)
        self.samplers = None
        if temperature > 0:
            self.samplers = []
            for s in range(self.n_seq):
                chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(top_p, 1))
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed + s))
                self.samplers.append(chain)
        return {"ok": True}

    def _next(self, i: int, seq: int) -> int:
        """The token after logits row i of sequence seq: greedy, or the sampler chain's."""
        if self.samplers is None:
            return self._argmax(i)
        return int(L.llama_sampler_sample(self.samplers[seq], self.ctx, i))

    def _argmax(self, i: int) -> int:
        ptr = L.llama_get_logits_ith(self.ctx, i)
        row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                    shape=(self.vocab,))
        return int(row.argmax())

    def _prefill(self, prompts: list[list[int]]) -> list[int]:
        """All prompts, n_batch tokens per llama_decode; returns each one's first token."""
        items = [(t, p, s, p == len(pr) - 1) for s, pr in enumerate(prompts)
                 for p, t in enumerate(pr)]
        first = [0] * len(prompts)
        for i in range(0, len(items), self.n_batch):
            chunk = items[i:i + self.n_batch]
            self._decode(chunk)
            for j, (_, _, s, want) in enumerate(chunk):
                if want:
                    first[s] = self._next(j, s)
        return first

    def single(self, prompt: list[int], out: int) -> dict:
        self.clear()
        t0 = time.perf_counter()
        tok = self._prefill([prompt])[0]
        t1 = time.perf_counter()
        tokens = [tok]
        for step in range(out - 1):
            self._decode([(tok, len(prompt) + step, 0, True)])
            tok = self._next(0, 0)
            tokens.append(tok)
        t2 = time.perf_counter()
        return {"seconds": t2 - t0, "prefill_seconds": t1 - t0, "decode_seconds": t2 - t1,
                "tokens": tokens}

    def batch_run(self, prompts: list[list[int]], out: int) -> dict:
        self.clear()
        t0 = time.perf_counter()
        toks = self._prefill(prompts)
        tokens = [[t] for t in toks]
        for step in range(out - 1):
            self._decode([(toks[s], len(p) + step, s, True) for s, p in enumerate(prompts)])
            toks = [self._next(s, s) for s in range(len(prompts))]
            for s, t in enumerate(toks):
                tokens[s].append(t)
        t1 = time.perf_counter()
        return {"seconds": t1 - t0, "output_tokens": sum(len(t) for t in tokens),
                "tokens": tokens}

    def prefill(self, prompt: list[int]) -> dict:
        self.clear()
        t0 = time.perf_counter()
        self._prefill([prompt])
        return {"seconds": time.perf_counter() - t0}


def main() -> None:
    model, threads, max_seqs, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4])
    peer = Peer(model, threads, max_seqs, n_ctx)
    print(json.dumps({"ready": True, "version": L.__version__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "single":
            res = peer.single(cmd["prompt"], cmd["out"])
        elif op == "batch":
            res = peer.batch_run(cmd["prompts"], cmd["out"])
        elif op == "prefill":
            res = peer.prefill(cmd["prompt"])
        elif op == "sampling":
            res = peer.sampling(cmd["temperature"], cmd.get("top_p", 1.0), cmd.get("seed", 0))
        else:
            res = {"error": f"unknown op {op!r}"}
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
