"""The compiled decode blocks' arguments (ops/csrc/*_block.h), built once from the
model for kdaserve/model/fused_decode.py: per layer the token mixer's and the feed-forward's
weights as pointers (matrices in the model's dtype, read in place when contiguous; vectors in
fp32), sizes and scalars, and each block's scratch need; K3's attention-residual vectors; the
head. The tensors whose memory the pointers name are kept alive here."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from kdaserve.model.base import DecoderLayer, HybridForCausalLM
from kdaserve.model.kda import KimiDeltaAttention
from kdaserve.model.layers import MLP
from kdaserve.model.moe import SparseMoE
from kdaserve.model.packed_args import Descriptors, has_packed
from kdaserve.ops.cpu_linear import k_major
from kdaserve.ops.moe_kernel import activation_args

_I, _F = ctypes.c_int64, ctypes.c_float

_NULL = ctypes.c_void_p(None)


def _p(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"


class BlockArgs:
    """Argument tuples for the compiled blocks of one model (see the module doc)."""

    def __init__(self, model: HybridForCausalLM) -> None:
        self.model = model
        self.wdtype = model.dtype          # matrices stay in it; vectors are taken in fp32
        self.hidden = model.config.hidden_size
        self.keep: list[torch.Tensor] = []      # tensors whose memory the calls read
        # packed INT8/INT4 layers: every matrix goes to the blocks' _q copy as a descriptor
        self.packed = has_packed(model)
        self._desc = Descriptors(self.keep)

    def _t(self, t: torch.Tensor) -> ctypes.c_void_p:
        """A vector (norm weight, bias) or fp32-kept matrix (router), as fp32."""
        t = t.detach()
        if not _f32(t):
            t = t.float().contiguous()
        self.keep.append(t)
        return _p(t)

    def _w(self, t: torch.Tensor) -> ctypes.c_void_p:
        """A weight matrix in the model's dtype, read in place when contiguous."""
        t = t.detach()
        if t.dtype != self.wdtype or not t.is_contiguous():
            t = t.to(self.wdtype).contiguous()
        self.keep.append(t)
        return _p(t)

    def _wt(self, m: nn.Module | torch.Tensor) -> ctypes.c_void_p:
        """A projection (a linear layer, or its weight [out, in]) read transposed ([in, out],
        K-major) in the model's dtype, for the blocks' outer-product products (row_products.h
        `matmat_t`): in place when the model stores it K-major (fp32 on CPU,
        kdaserve/ops/cpu_linear.py), else a transposed copy (bf16: the torch forms keep the
        checkpoint's layout). A model with packed INT layers: a descriptor (packed_args.py)."""
        if self.packed:
            return self._desc.matrix(m)
        t = m.weight if isinstance(m, nn.Module) else m
        return self._w(t.detach().t().to(self.wdtype).contiguous())

    def mixer(self, layer: DecoderLayer) -> tuple:
        attn, norm = layer.self_attn, layer.input_layernorm
        hd = self.hidden
        if isinstance(attn, KimiDeltaAttention):
            H, D = attn.num_heads, attn.head_dim
            lins = attn._input_linears()
            fused = attn._fused
            if self.packed and attn._fused_q is not None:
                w_in = attn._fused_q
            elif fused is not None and [lin.weight.data_ptr() for lin in lins] == attn._fused_ptrs:
                w_in = fused
            else:
                w_in = torch.cat([lin.weight.detach() for lin in lins], 0)
            G = lins[4].out_features
            taps = attn.q_conv1d.kernel_size[0]
            lb = attn.gate_lower_bound
            static = dict(
                head=(_I(hd), _I(H), _I(D), _I(G), _I(taps)),
                norm=(self._t(norm.weight), _F(norm.eps), self._wt(w_in)),
                conv=(self._t(attn._conv_weight_t()), self._wt(attn.f_b_proj),
                      self._t(attn.dt_bias), self._t(attn.A_log.detach().view(H).exp()),
                      _F(0.0 if lb is None else lb), _I(lb is not None),
                      self._wt(attn.g_b_proj) if not attn.full_rank_gate
                      else ctypes.c_void_p(None),
                      self._t(attn.o_norm.weight), _F(attn.o_norm.eps),
                      self._wt(attn.o_proj), _F(D ** -0.5)),
                index=attn.kda_index)
            P = 3 * H * D + D + G + H
            return ("kda", static, (2 * hd + P + 6 * H * D, 3 * D + 4 * max(hd, H * D, D)))
        H, N, R = attn.num_heads, attn.nope, attn.rope
        Dc, Vd = attn.kv_lora_rank, attn.v_dim
        if hasattr(attn, "q_proj"):
            q_lora, Qr = (_NULL, _NULL, _F(0.0)), 0
            w_q = attn.q_proj
        else:
            qn = attn.q_a_layernorm
            q_lora, Qr = (self._wt(attn.q_a_proj), self._t(qn.weight), _F(qn.eps)), \
                attn.q_a_proj.out_features
            w_q = attn.q_b_proj
        gate = self._wt(attn.g_proj) if hasattr(attn, "g_proj") else _NULL
        static = dict(
            head=(_I(hd), _I(H), _I(N), _I(R), _I(Dc), _I(Vd)),
            weights=(self._t(norm.weight), _F(norm.eps), *q_lora, _I(Qr), self._wt(w_q),
                     self._wt(attn.kv_a_proj_with_mqa),
                     self._t(attn.kv_a_layernorm.weight), _F(attn.kv_a_layernorm.eps),
                     self._w(attn.kv_b_proj.weight)),       # (dequantized when packed)
            tail=(gate, self._wt(attn.o_proj), _F(attn.scale)),
            index=attn.mla_index)
        return ("mla", static, (2 * hd + H * (N + R) + Dc + R + 2 * H * Vd + Qr,
                                H * Dc + Dc + R + 4 * max(hd, H * Vd)))

    def ffn(self, layer: DecoderLayer) -> tuple:
        ffn, norm = layer.ffn, layer.post_attention_layernorm
        hd = self.hidden
        act = tuple(f(v) for f, v in zip((_I, _F, _F), activation_args(ffn.act)))
        if isinstance(ffn, MLP):
            i = ffn.gate_proj.out_features
            args = (_I(hd), _I(i), None, self._t(norm.weight), _F(norm.eps),
                    self._wt(ffn.gate_proj), self._wt(ffn.up_proj), self._wt(ffn.down_proj),
                    *act)
            return ("mlp", args, (3 * hd + 2 * i, 4 * max(hd, i)))
        sh = ffn.shared_experts
        i_s = sh.gate_proj.out_features if sh is not None else 0
        E, inter, Wd = ffn.num_experts, ffn.intermediate, ffn.width
        r = ffn.gate
        if ffn.is_latent:
            ln = ffn.routed_expert_norm
            latent = (self._wt(ffn.routed_expert_down_proj),
                      self._t(ln.weight) if ln is not None else _NULL,
                      _F(ln.eps if ln is not None else 0.0),
                      self._wt(ffn.routed_expert_up_proj))
        else:
            latent = (_NULL, _NULL, _F(0.0), _NULL)
        args = (_I(hd), _I(E), _I(inter), _I(r.top_k), None, self._t(norm.weight), _F(norm.eps),
                self._t(r.weight), self._t(r.e_score_correction_bias), _I(r.renormalize),
                _F(r.scaling), *self._experts(ffn),
                self._wt(sh.gate_proj) if sh is not None else _NULL,
                self._wt(sh.up_proj) if sh is not None else _NULL,
                self._wt(sh.down_proj) if sh is not None else _NULL,
                _I(i_s), *act, _I(Wd), *latent)
        K = r.top_k
        return ("moe", args, (3 * hd + E + 2 * K + 2 * Wd + K * (Wd + 3 * inter) + 2 * i_s,
                              E + 4 * max(hd, 2 * inter, i_s)))

    def attn_res(self, model: HybridForCausalLM) -> dict | None:
        """K3's block attention-residuals: per layer the folded mix vectors before the mixer
        and the feed-forward (norm weight * proj weight, model/attn_res.py) and whether the
        layer starts a block; the output mix's vector; the bank's size."""
        new_bank = getattr(model, "new_bank", None)
        if new_bank is None or new_bank() is None:
            return None
        fold = (lambda norm, proj: self._t(norm.weight.detach().float()
                                          * proj.weight.detach().float().view(-1)))
        layers = [(fold(ly.self_attention_res_norm, ly.self_attention_res_proj),
                   fold(ly.mlp_res_norm, ly.mlp_res_proj), ly.is_block_start)
                  for ly in model.model.layers]
        m = model.model
        return dict(layers=layers, out=fold(m.output_attn_res_norm, m.output_attn_res_proj),
                    eps=_F(model.config.rms_norm_eps),
                    sources=sum(start for _, _, start in layers))

    def head(self) -> tuple:
        """(Hd, V, norm weight, eps, W, ldw): a K-major head in the model's dtype is read in
        place, rows ldw apart (cpu_linear.py may pad them); any other is a compact copy."""
        m = self.model
        norm, w = m.model.norm, m.lm_head.weight.detach()
        if not self.packed and w.dtype == self.wdtype and k_major(w):
            self.keep.append(w)
            weight, ldw = _p(w), w.stride(1)
        else:
            weight, ldw = self._wt(m.lm_head), m.lm_head.out_features
        return (_I(self.hidden), _I(m.lm_head.out_features), self._t(norm.weight),
                _F(norm.eps), weight, _I(ldw))

    def _experts(self, ffn: SparseMoE) -> tuple:
        """(w13, w2, transposed): the stacks read in place, in whichever layout they are."""
        if self.packed:
            return (*self._desc.experts(ffn), _I(1))
        w13t, w2t = ffn.experts_w13.transpose(1, 2), ffn.experts_w2.transpose(1, 2)
        if w13t.is_contiguous() and w2t.is_contiguous():
            return self._w(w13t), self._w(w2t), _I(1)
        return self._w(ffn.experts_w13), self._w(ffn.experts_w2), _I(0)
