"""The fused decode path: a step of single-token decode rows on CPU through one compiled call
per token mixer and per feed-forward (ops/csrc/decode_cpu.c), instead of ~40 torch ops and
their Python per layer.

It serves Kimi Linear and Kimi K3 layers on CPU (KDA with either gate, MLA without rope, with
q_proj or a query LoRA and K3's optional output gate, SiLU or SiTU dense MLP, sigmoid-routed
MoE with plain top-k and unquantized experts, latent or not; K3's block attention-residuals
mixed by one compiled call before each sublayer) and rows that each carry one token with
context. Weights
and cache are fp32, or bf16 (--dtype bfloat16: read as the model keeps them, activations and
sums in fp32, so closer to the fp32 model than the torch bf16 forward, which rounds every
op's output; on the bundled model's test prompts it decodes the fp32 greedy tokens, the torch
bf16 forward does not).
A model with packed INT8/INT4 layers (kdaserve/model/quantize.py) runs the blocks' _q copy:
fp32 activations and cache, each matrix a descriptor the products decode from its packed
bytes (kdaserve/model/packed_args.py; tests/model/test_fused_decode_quant.py).
Everything else (prefill, drafts, snapshots, other dtypes or variants) takes the model's
forward, which stays the reference: tests/model/test_fused_decode.py checks logits and greedy
tokens against it. `fused_decoder(model)` returns None where the path does not apply;
KDASERVE_FUSED_DECODE=0 turns it off.

Weights are read through pointers taken once, so the decoder keeps the tensors alive and
checks before each step that the parameters it read are still the model's (a reload or a
dtype change turns the path off rather than reading stale memory).
"""

from __future__ import annotations

import os
import threading

import torch

from kdaserve.model.base import DecoderLayer, HybridForCausalLM
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.fused_args import _I, _NULL, BlockArgs, _p
from kdaserve.model.fused_plain import PlainCalls
from kdaserve.model.fused_rows import (  # noqa: F401 (the runner's names for them)
    MAX_FUSED_ROWS,
    Kept,
    RowInputs,
    applies,
    split_parts,
)
from kdaserve.model.kda import KimiDeltaAttention
from kdaserve.model.layers import MLP
from kdaserve.model.mla import MultiHeadLatentAttention
from kdaserve.model.moe import SparseMoE
from kdaserve.model.packed_args import has_packed, packed_footprint
from kdaserve.ops import stream_tune
from kdaserve.ops.cpu_kernels import decode_block_kernels, thread_pool


class FusedDecoder:
    """Per-layer argument lists for the compiled blocks, built once from the model."""

    def __init__(self, model: HybridForCausalLM, kernels) -> None:
        self.model = model
        self.k = kernels
        args = BlockArgs(model)
        self.wdtype, self.hidden = args.wdtype, args.hidden
        self._keep = args.keep                   # tensors whose memory the calls read
        head = model.lm_head       # (a packed head's `weight` is a fresh dequantized tensor)
        self._witness_params = [model.model.embed_tokens.weight,
                                head.weight_packed if hasattr(head, "weight_packed")
                                else head.weight] + [
            layer.input_layernorm.weight for layer in model.model.layers]
        self._witness = self._fingerprint()
        self.layers: list[tuple] = []
        # scratch floats of a block for B rows: per_row * B + fixed (ops/csrc/*_block.h)
        per_row, fixed = 5 * self.hidden, 4 * self.hidden
        for layer in model.model.layers:
            mixer, ffn = args.mixer(layer), args.ffn(layer)
            per_row = max(per_row, mixer[2][0], ffn[2][0])
            fixed = max(fixed, mixer[2][1], ffn[2][1])
            self.layers.append((mixer, ffn))
        self.head = args.head()
        self.res = args.attn_res(model)
        self._scratch_size = (per_row, fixed + 1024)
        self._scratch: dict[int, torch.Tensor] = {}      # by part (row split), grown as needed
        self._plain = PlainCalls(self.hidden)    # the plain step's calls (fused_plain.py)
        self._team: tuple[int, int] | None = None   # (calling thread, team size) last set

    @property
    def k(self):
        """The compiled blocks' table (decode_block_kernels)."""
        return self._k

    @k.setter
    def k(self, kernels) -> None:
        # the plain step's calls hold the table's functions: a new table (a timed one, `bench
        # blocks`) needs them built again
        self._k = kernels
        if hasattr(self, "_plain"):
            self._plain.clear()

    def _fingerprint(self) -> tuple:
        """Pointers of the embedding, the head and each layer's input norm: a reload or a
        dtype change replaces them all (checking every parameter would cost ~1 ms a step)."""
        return tuple((p.data_ptr(), p.dtype) for p in self._witness_params)

    def still_valid(self) -> bool:
        return self._fingerprint() == self._witness

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_table: torch.Tensor, cache: HybridCache,
                 snapshots: list[tuple[int, int]] = (), capture: tuple[int, ...] = (),
                 captured: list[torch.Tensor] | None = None, parts: int = 1,
                 kept: Kept | None = None) -> torch.Tensor:
        """ids, positions, slots [B] int64; block_table [B, width] int64 (contiguous).
        Writes the rows' KDA states, conv windows and MLA latents into the cache and returns
        the logits [B, vocab]. snapshots: (row, snapshot id) pairs whose state after this
        token is saved (a decode row can only snapshot its final state). The stream after
        each layer in `capture` is appended to `captured` (a speculative draft's context),
        as the torch forward's capture_layers. parts > 1 (see split_parts): the rows are
        split over that many threads. Rows may share a slot: a token and its drafts at
        consecutive positions, each continuing the state the one before left; `kept` then
        receives every row's state after its token (a rejected draft's rollback)."""
        model = self.model
        if self.k.parallel:      # the team size is per calling thread: torch's (which
            # torch.set_num_threads sets on its thread too), told again when either changes
            team = (threading.get_ident(), torch.get_num_threads())
            if team != self._team:
                self.k.threads(team[1])
                self._team = team
        ids, slots, positions = ids.contiguous(), slots.contiguous(), positions.contiguous()
        block_table = block_table.contiguous()
        B = ids.shape[0]
        logits = torch.empty(B, self.head[1].value, dtype=torch.float32)
        if parts <= 1 and not capture and kept is None and self.res is None:
            self._plain.run(self, ids, positions, slots, block_table, cache, logits)
            self._snapshot(snapshots, slots, cache)
            return logits
        x = torch.embedding(model.model.embed_tokens.weight, ids)   # (nn.Module's call: 3x)
        if x.dtype != torch.float32:
            x = x.float()
        # K3: x is the in-block running sum P; mix [B, Hd] each sublayer's mixed input, bank
        # [B, sources, Hd] the finished block sums (model/attn_res.py)
        res = (torch.empty_like(x), torch.empty(B, max(1, self.res["sources"]), self.hidden))\
            if self.res is not None else None
        if parts <= 1 or capture or kept is not None:
            self.rows(0, 0, B, x, positions, slots, block_table, cache, logits, res, capture,
                       captured, kept)
        else:
            # decode rows are independent through the whole stack (each its own state slot
            # and pages): each thread runs every layer for its share (the calls drop the GIL)
            bounds = [B * i // parts for i in range(parts + 1)]
            futures = [thread_pool(parts).submit(self._rows_in_mode, i, bounds[i],
                                                 bounds[i + 1], x, positions, slots,
                                                 block_table, cache, logits, res)
                       for i in range(parts)]
            for f in futures:
                f.result()
        self._snapshot(snapshots, slots, cache)
        return logits

    @staticmethod
    def _snapshot(snapshots: list[tuple[int, int]], slots: torch.Tensor, cache: HybridCache
                  ) -> None:
        if snapshots and cache.snap_states:
            src = slots[[r for r, _ in snapshots]]
            dest = torch.tensor([d for _, d in snapshots], dtype=torch.long)
            for st, cv, sst, scv in zip(cache.kda_states, cache.kda_conv, cache.snap_states,
                                        cache.snap_conv):
                sst.index_copy_(0, dest, st[src])
                scv.index_copy_(0, dest, cv[src].to(scv.dtype))

    def scratch_for(self, part: int, rows: int) -> torch.Tensor:
        per_row, fixed = self._scratch_size
        need = per_row * rows + fixed
        scratch = self._scratch.get(part)
        if scratch is None or scratch.numel() < need:
            scratch = self._scratch[part] = torch.empty(need, dtype=torch.float32)
        return scratch

    @torch.inference_mode()      # the mode is per thread: the pool's need it too
    def _rows_in_mode(self, *args) -> None:
        self.rows(*args)

    def rows(self, part: int, lo: int, hi: int, x: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor, block_table: torch.Tensor, cache: HybridCache,
              logits: torch.Tensor | None, res: tuple[torch.Tensor, torch.Tensor] | None = None,
              capture: tuple[int, ...] = (), captured: list[torch.Tensor] | None = None,
              kept: Kept | None = None, record: list | None = None) -> None:
        """Rows [lo, hi) through every layer and the head, with scratch `part`. record: the
        calls (function, arguments) are appended to it instead of made (the plain step's, no
        residual mixes or capture; the head's last, its logits pointer None)."""
        n = hi - lo
        scratch = self.scratch_for(part, n)
        B, sp = _I(n), _p(scratch)
        call = record.append if record is not None else (lambda c: c[0](*c[1]))
        xp = _p(x[lo:hi])
        slots_p, pos_p, bt_p = _p(slots[lo:hi]), _p(positions[lo:hi]), _p(block_table[lo:hi])
        width = _I(block_table.shape[1])
        bs = _I(cache.block_size)
        k = self.k
        hd = _I(self.hidden)
        inp = xp                    # what each sublayer normalises: the stream, or K3's mix
        if res is not None:
            mix, bank = res[0][lo:hi], res[1][lo:hi]
            inp, bank_p, stride = _p(mix), _p(bank), _I(bank.stride(0))
            eps, banked = self.res["eps"], 0
        for li, ((kind, st, _), (fkind, fargs, _)) in enumerate(self.layers):
            if res is not None:
                w_attn, w_mlp, block_start = self.res["layers"][li]
                k.mix(B, hd, _I(banked), bank_p, stride, xp, w_attn, eps, inp)
                if block_start:     # P is banked after the mix and restarts from the mixer
                    bank[:, banked].copy_(x[lo:hi])
                    x[lo:hi].zero_()
                    banked += 1
            if kind == "kda":
                i = st["index"]
                ks, kc = ((_p(kept.states[i][lo:hi]), _p(kept.conv[i][lo:hi]))
                          if kept is not None else (_NULL, _NULL))
                call((k.kda, (B, *st["head"], xp, inp, *st["norm"], _p(cache.kda_conv[i]),
                              _p(cache.kda_states[i]), slots_p, *st["conv"], sp, ks, kc)))
            else:
                pages = cache.mla_pages[st["index"]]
                call((k.mla, (B, *st["head"], xp, inp, *st["weights"], _p(pages), bs, bt_p,
                              width, pos_p, *st["tail"], sp)))
            if res is not None:
                k.mix(B, hd, _I(banked), bank_p, stride, xp, w_mlp, eps, inp)
            if fkind == "mlp":
                call((k.mlp, (B, *fargs[:2], xp, inp, *fargs[3:], sp)))
            else:
                call((k.moe, (B, *fargs[:4], xp, inp, *fargs[5:], sp)))
            if li in capture and captured is not None:
                captured.append(x.clone())
        if res is not None:
            k.mix(B, hd, _I(banked), bank_p, stride, xp, self.res["out"], eps, inp)
        call((k.head, (B, *self.head[:2], inp, *self.head[2:],
                       _p(logits[lo:hi]) if logits is not None else _NULL, sp)))


def fused_decoder(model: HybridForCausalLM, cache: HybridCache) -> FusedDecoder | None:
    """A FusedDecoder for this model and cache, or None where the path does not apply."""
    if os.environ.get("KDASERVE_FUSED_DECODE", "1") == "0" or not supports(model, cache):
        return None
    packed = has_packed(model)
    kernels = decode_block_kernels("q" if packed else
                                   "f32" if model.dtype == torch.float32 else "bf16")
    if kernels is None:
        return None
    if packed:                       # a lone row's prefetch distance, for this machine
        stream_tune.tune(*packed_footprint(model))
    return FusedDecoder(model, kernels)


def supports(model: HybridForCausalLM, cache: HybridCache) -> bool:
    cfg = model.config
    if getattr(model, "_rank_config", None) is not None:
        return False          # a parallel rank's share: its hooks all-reduce what fused skips
    if type(model).final_hidden is not HybridForCausalLM.final_hidden and \
            getattr(model, "new_bank", None) is None:
        return False          # a residual scheme the blocks do not know
    dtype = model.dtype
    if has_packed(model) and dtype != torch.float32:
        return False          # packed INT layers: fp32 activations and cache (the _q blocks)
    if dtype not in (torch.float32, torch.bfloat16) or \
            model.model.embed_tokens.weight.device.type != "cpu":
        return False
    if any(t.dtype != dtype for t in cache.mla_pages + cache.kda_conv):
        return False
    for layer in model.model.layers:
        if not isinstance(layer, DecoderLayer):
            return False
        attn, ffn = layer.self_attn, layer.ffn
        if isinstance(attn, MultiHeadLatentAttention):
            if attn.use_rope:
                return False
        elif not isinstance(attn, KimiDeltaAttention):
            return False
        if not isinstance(ffn, (MLP, SparseMoE)):
            return False
        if isinstance(ffn, SparseMoE):
            r = ffn.gate
            if ((ffn.quantized and ffn.int_quant is None) or r.groups > 1
                    or r.activation != "sigmoid"
                    or (ffn.shared_experts is not None
                        and ffn.shared_experts.act != ffn.act)):
                return False
    return cfg.num_hidden_layers == len(model.model.layers)


