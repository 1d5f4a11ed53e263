"""The KDA token mixer (Kimi Delta Attention layer) with checkpoint parameter names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.model.batch import ForwardBatch
from kdaserve.model.layers import GatedRMSNorm
from kdaserve.model.quant_linear import QuantLinear, fuse_packed
from kdaserve.model_config import ModelConfig
from kdaserve.ops.conv import causal_conv1d_packed, conv_input_rows
from kdaserve.ops.cpu_linear import k_major_weight, linear
from kdaserve.ops.registry import kda_ops


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)

_PREPARE_DTYPES = {torch.float32, torch.bfloat16}


class KimiDeltaAttention(nn.Module):
    """Legend: T tokens, B sequences, H heads, D head dim (K = V = D), L padded length.

    Output gate: Kimi Linear's low-rank g_b_proj(g_a_proj(x)), or K3's full-rank g_proj(x)
    (`use_full_rank_gate`): out = o_proj(RMSNorm_D(o) · o_norm.w · sigmoid(gate)).
    Decay: -exp(A_log)·softplus(f + dt_bias), or with `gate_lower_bound` lb (K3: -5)
    lb·sigmoid(exp(A_log)·(f + dt_bias)). K3 stores A_log as [H], Kimi Linear as [1,1,H,1].
    """

    def __init__(self, cfg: ModelConfig, kda_index: int, chunk_size: int = 16) -> None:
        super().__init__()
        h, d, hidden = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size
        self.num_heads, self.head_dim, self.kda_index = h, d, kda_index
        self.chunk_size = chunk_size
        self.gate_lower_bound = cfg.kda_gate_lower_bound
        self.q_proj = nn.Linear(hidden, h * d, bias=False)
        self.k_proj = nn.Linear(hidden, h * d, bias=False)
        self.v_proj = nn.Linear(hidden, h * d, bias=False)
        kernel = cfg.conv_kernel_size
        self.q_conv1d = nn.Conv1d(h * d, h * d, kernel, groups=h * d, bias=False)
        self.k_conv1d = nn.Conv1d(h * d, h * d, kernel, groups=h * d, bias=False)
        self.v_conv1d = nn.Conv1d(h * d, h * d, kernel, groups=h * d, bias=False)
        self.f_a_proj = nn.Linear(hidden, d, bias=False)
        self.f_b_proj = nn.Linear(d, h * d, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(h * d, dtype=torch.float32))
        a_shape = (h,) if cfg.architecture == "kimi_k3" else (1, 1, h, 1)
        self.A_log = nn.Parameter(torch.zeros(*a_shape, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden, h, bias=False)
        self.full_rank_gate = cfg.kda_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = nn.Linear(hidden, h * d, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, d, bias=False)
            self.g_b_proj = nn.Linear(d, h * d, bias=False)
        self.o_norm = GatedRMSNorm(d, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(h * d, hidden, bias=False)
        self._fused: torch.Tensor | None = None       # see fuse_input_projections
        self._fused_ptrs: list[int] = []
        self._conv_wt: tuple[tuple, torch.Tensor] | None = None  # see _conv_weight_t
        self._fused_q: QuantLinear | None = None     # packed input projections, fused

    def _input_linears(self) -> list[nn.Linear]:
        gate_in = self.g_proj if self.full_rank_gate else self.g_a_proj
        return [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate_in, self.b_proj]

    def _gate(self, gate_in: torch.Tensor) -> torch.Tensor:
        """The output gate's pre-sigmoid [T, HD] from the gate input projection."""
        return gate_in if self.full_rank_gate else self.g_b_proj(gate_in)

    def fuse_input_projections(self, k_major: bool = False) -> list[nn.Linear]:
        """Inference: the six projections of the layer input (q, k, v, f_a, g_a|g, b) become one
        matmul. Their weights are re-pointed as row views of one tensor, so nothing is stored
        twice and checkpoint names stay; if a weight is replaced later (dtype change, reload),
        its pointer no longer matches and the layer goes back to separate matmuls. k_major:
        that tensor is stored K-major (kdaserve/ops/cpu_linear.py). Returns the layers fused."""
        lins = self._input_linears()
        if self._fused_ptrs and self._fused_ptrs == [
                (lin.weight_packed if isinstance(lin, QuantLinear) else lin.weight).data_ptr()
                for lin in lins]:
            # fused already (a model handed to a second engine): fusing again would copy it
            return [] if self._fused_q is not None else lins
        if all(isinstance(lin, QuantLinear) for lin in lins):
            # not a submodule: the layers keep their checkpoint names and their bytes
            object.__setattr__(self, "_fused_q", fuse_packed(lins))
            self._fused_ptrs = [lin.weight_packed.data_ptr() for lin in lins]
            return []
        if any(type(lin) is not nn.Linear for lin in lins) or \
                len({lin.weight.dtype for lin in lins}) != 1:
            return []
        fused = torch.cat([lin.weight.detach() for lin in lins], 0)
        if k_major:
            fused = k_major_weight(fused).data
        start = 0
        for lin in lins:
            n = lin.weight.shape[0]
            lin.weight = nn.Parameter(fused[start:start + n], requires_grad=False)
            start += n
        self._fused = fused
        self._fused_ptrs = [lin.weight.data_ptr() for lin in lins]
        return lins

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
        """x [T,hidden] -> (q|k|v [T,3HD], f_a [T,D], gate input [T,D or HD], b [T,H])."""
        lins = self._input_linears()
        if self._fused is not None and [lin.weight.data_ptr() for lin in lins] == self._fused_ptrs:
            hd3 = 3 * self.num_heads * self.head_dim
            return linear(x, self._fused).split([hd3, self.head_dim, lins[4].weight.shape[0],
                                                   self.num_heads], -1)
        fq = self._fused_q         # packed: one product over the six layers' rows
        if fq is not None and [lin.weight_packed.data_ptr() for lin in lins] == self._fused_ptrs:
            return fq(x).split([3 * self.num_heads * self.head_dim, self.head_dim,
                                lins[4].out_features, self.num_heads], -1)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        return qkv, self.f_a_proj(x), lins[4](x), self.b_proj(x)

    def _conv_weight_t(self) -> torch.Tensor:
        """The three depthwise conv weights as one [taps, 3HD] fp32 tensor (the compiled
        prepare's layout), rebuilt only when a weight is replaced or changed in place."""
        ws = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        key = tuple((id(w), w.data_ptr(), w._version, w.dtype) for w in ws)
        if self._conv_wt is None or self._conv_wt[0] != key:
            wt = torch.cat([w.detach() for w in ws], 0).squeeze(1).t().float().contiguous()
            self._conv_wt = (key, wt)
        return self._conv_wt[1]

    def decay(self, f_a: torch.Tensor) -> torch.Tensor:
        """Log-space decay g [T,H,D] (fp32, <= 0) from the f_a projection [T,D] of the input."""
        raw = self.f_b_proj(f_a).float() + self.dt_bias.float()
        raw = raw.view(f_a.shape[0], self.num_heads, self.head_dim)
        a = self.A_log.float().view(1, self.num_heads, 1).exp()
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * torch.sigmoid(a * raw)
        return -a * F.softplus(raw)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        B, Bd, Td = fb.num_seqs, fb.num_decode, fb.num_decode_tokens
        H, D = self.num_heads, self.head_dim
        cache = fb.cache
        km1 = self.q_conv1d.kernel_size[0] - 1

        pre, f_a, g_a, b_raw = self._project(x)                                 # pre [T, 3HD]
        C = pre.shape[-1]
        if cache is not None:
            conv_store = cache.kda_conv[self.kda_index]
            state_store = cache.kda_states[self.kda_index]
            window = conv_store[fb.state_slots]
            if fb.num_fresh:  # sequences that start now begin from a zero window and state
                window.mul_(fb.has_initial_state.view(B, 1, 1).to(window.dtype))
        else:
            window = pre.new_zeros(B, km1, C)
        lay = fb.kda
        plan = fb.snapshots
        dec = fb.decode
        snap_idx = plan.window_idx if plan is not None else None
        dec_idx = dec.window_idx if dec is not None and cache is not None else None
        parts = [i for i in (snap_idx, dec_idx) if i is not None]
        extra_idx = torch.cat(parts, 0) if parts else None
        ops = kda_ops(x.device, needs_grad=torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in self.parameters())))
        if ops.prepare is not None and {pre.dtype, window.dtype} <= _PREPARE_DTYPES:
            # bf16 projections are widened: the kernel computes in fp32 (as the recurrence
            # does), where bf16 torch ops on CPU are many times slower than fp32 ones
            q, k, v, g, beta, new_window = ops.prepare(
                pre.float(), window.float(), fb.cu_seqlens, self._conv_weight_t(),
                self.f_b_proj(f_a).float(), self.dt_bias.float(), self.A_log.view(H).exp().float(),
                b_raw.float(), H, D ** -0.5, self.gate_lower_bound)
            windows = conv_input_rows(pre, window, extra_idx) if parts else None
        else:
            w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0)
            conv, new_window, windows = causal_conv1d_packed(
                pre, window, w.squeeze(1), lay.conv_groups, lay.conv_state_idx, extra_idx)
            q, k, v = F.silu(conv).float().view(T, 3, H, D).unbind(1)
            q = l2norm(q) * D ** -0.5
            k = l2norm(k)
            g = self.decay(f_a)
            beta = torch.sigmoid(b_raw.float())                                 # [T, H]
        n_snap = snap_idx.shape[0] if snap_idx is not None else 0
        snap_windows = windows[:n_snap] if windows is not None else None
        if dec_idx is not None:
            fb.out.decode_windows[self.kda_index] = windows[n_snap:]

        outs = []
        if Bd:  # decode rows continue their slot's state, updated in place
            if dec is None:                                                    # one token each
                def dpad(t: torch.Tensor) -> torch.Tensor:                # [Td,..]->[Bd,1,..]
                    return t[:Td].unsqueeze(1)
            else:                                            # a token and its drafts: padded
                def dpad(t: torch.Tensor) -> torch.Tensor:               # [Td,..]->[Bd,Ld,..]
                    return torch.cat([t[:Td], t.new_zeros((1,) + t.shape[1:])], 0)[dec.pad_src]

            o_d, kept = ops.recurrent_slots(
                state_store, fb.state_slots[:Bd], dpad(q), dpad(k), dpad(v), dpad(g), dpad(beta),
                keep_states=dec is not None, scratch=cache.state_scratch)
            o_d = o_d.reshape(-1, H, D)
            outs.append(o_d if dec is None else o_d[dec.unpad_idx])
            if kept is not None:
                fb.out.decode_states[self.kda_index] = kept
        s_p = None
        if B > Bd:
            Bp, L = lay.pad_src.shape
            if cache is not None:
                s0 = torch.index_select(state_store, 0, fb.state_slots[Bd:],
                                        out=cache.state_scratch[:Bp])                # a copy
                if fb.num_fresh:
                    s0.mul_(fb.has_initial_state[Bd:].view(Bp, 1, 1, 1))
            else:
                s0 = torch.zeros(Bp, H, D, D, dtype=torch.float32, device=x.device)

            def pad(t: torch.Tensor) -> torch.Tensor:                     # [Tp,..]->[Bp,L,..]
                if lay.pad_is_reshape:
                    return t[Td:].reshape(Bp, L, *t.shape[1:])
                t = torch.cat([t[Td:], t.new_zeros((1,) + t.shape[1:])], 0)
                return t[lay.pad_src]

            o_p, s_p, kept = ops.chunk(pad(q), pad(k), pad(v), pad(g), pad(beta), s0,
                                       self.chunk_size, fb.keep_chunk_states)
            o_p = o_p.reshape(Bp * L, H, D)
            outs.append(o_p if lay.pad_is_reshape else o_p[lay.unpad_idx])
            if kept is not None:
                fb.out.chunk_states[self.kda_index] = kept
        o = torch.cat(outs, 0) if len(outs) > 1 else outs[0]                   # [T, H, D]
        if cache is not None:
            if s_p is not None:
                state_store.index_copy_(0, fb.state_slots[Bd:], s_p.to(state_store.dtype))
            conv_store.index_copy_(0, fb.state_slots, new_window.to(conv_store.dtype))
            if plan is not None:
                self._save_snapshots(cache, plan, state_store[fb.state_slots[plan.seq]],
                                     fb.out.chunk_states.get(self.kda_index), snap_windows, Bd)
        gate = self._gate(g_a).view(T, H, D)
        o = self.o_norm(o.to(x.dtype), gate).reshape(T, H * D)
        return self.o_proj(o)

    def _save_snapshots(self, cache, plan, states: torch.Tensor, kept: torch.Tensor | None,
                        windows: torch.Tensor, num_decode: int) -> None:
        """States at block boundaries: the step's final state of each snapshotting sequence
        (`states` [S,H,K,V]), or a chunk-end state of the chunked prefill (the kernel already
        produced it: no extra pass)."""
        if kept is not None:
            inner = kept[(plan.seq - num_decode).clamp(min=0), plan.chunk]
            states = torch.where(plan.final.view(-1, 1, 1, 1), states, inner)
        cache.snap_states[self.kda_index].index_copy_(0, plan.dest, states)
        snap_conv = cache.snap_conv[self.kda_index]
        snap_conv.index_copy_(0, plan.dest, windows.to(snap_conv.dtype))
