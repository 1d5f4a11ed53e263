"""What every hybrid causal LM of the family shares: the packed-batch forward, dtype and chunk
settings, inference layouts. A family's class builds its modules under the checkpoint's names
(`model`, `lm_head`) and may override the stream's pieces, `new_bank` / `run_stage` /
`final_hidden` (K3's attention-residuals do); a pipeline stage runs them over its own layers
(kdaserve/distributed/pipeline_model.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kdaserve.model.attn_res import ResidualBank
from kdaserve.model.batch import ForwardBatch, build_forward_batch
from kdaserve.model.kda import KimiDeltaAttention
from kdaserve.model.layers import MLP, RMSNorm
from kdaserve.model.mla import MultiHeadLatentAttention
from kdaserve.model.moe import SparseMoE
from kdaserve.model_config import ModelConfig
from kdaserve.ops.cpu_kernels import decode_block_kernels
from kdaserve.ops.cpu_linear import available as k_major_available
from kdaserve.ops.cpu_linear import store_k_major
from kdaserve.ops.moe_kernel import moe_experts_kernel

# Parameters kept in fp32 whatever the model dtype (as transformers does).
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "gate.weight", "e_score_correction_bias",
                       # INT8/INT4 group scales (kdaserve/ops/int_quant.py)
                       "weight_scale", "experts_w13_scale", "experts_w2_scale")


class DecoderLayer(nn.Module):
    """Token mixer (KDA or MLA by layer index) + feed-forward (dense or MoE), pre-norm."""

    def __init__(self, cfg: ModelConfig, layer: int, kda_index: int, mla_index: int,
                 chunk_size: int) -> None:
        super().__init__()
        self.self_attn: nn.Module = (
            KimiDeltaAttention(cfg, kda_index, chunk_size) if cfg.layer_kind(layer) == "kda"
            else MultiHeadLatentAttention(cfg, mla_index)
        )
        if cfg.is_moe(layer):
            self.block_sparse_moe = SparseMoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def feed_forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(h, sync_free=fb.sync_free)
        return self.mlp(h)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), fb)
        return x + self.feed_forward(self.post_attention_layernorm(x), fb)


def build_layers(cfg: ModelConfig, chunk_size: int,
                 layer_cls: type = DecoderLayer) -> nn.ModuleList:
    kda_idx = {layer: i for i, layer in enumerate(cfg.kda_layers)}
    mla_idx = {layer: i for i, layer in enumerate(cfg.mla_layers)}
    return nn.ModuleList(
        layer_cls(cfg, i, kda_idx.get(i, -1), mla_idx.get(i, -1), chunk_size)
        for i in range(cfg.num_hidden_layers))


class HybridForCausalLM(nn.Module):
    """Legend: T tokens (packed), S rows that need logits. Subclasses set `config`,
    `chunk_size` and provide `model` (embed_tokens, layers, norm) and `lm_head`."""

    config: ModelConfig
    chunk_size: int

    def set_chunk_size(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        for layer in self.model.layers:
            if isinstance(layer.self_attn, KimiDeltaAttention):
                layer.self_attn.chunk_size = chunk_size

    def fuse_for_inference(self) -> HybridForCausalLM:
        """Inference layouts: fuse projections that read the same input (see
        KimiDeltaAttention); on CPU, experts stored transposed for the compiled kernels (see
        SparseMoE): fp32 for the ragged-group kernel, bf16 for the fused decode blocks, which
        read 48-wide experts ~1.5x faster that way (docs/benchmarks.md); fp32 and bf16 on CPU,
        the projections stored K-major for the compiled products (kdaserve/ops/cpu_linear.py)."""
        k_major = (self.dtype in (torch.float32, torch.bfloat16)
                   and next(self.parameters()).device.type == "cpu" and k_major_available())
        fused: list[nn.Module] = []
        for layer in self.model.layers:
            if isinstance(layer.self_attn, KimiDeltaAttention):
                fused += layer.self_attn.fuse_input_projections(k_major)
            moe = getattr(layer, "block_sparse_moe", None)
            if (moe is not None and not moe.quantized
                    and moe.experts_w13.device.type == "cpu"
                    and _transposed_experts_read(moe.experts_w13.dtype)):
                moe.transpose_expert_storage()
        if k_major:
            store_k_major(self.model.layers, skip=tuple(fused))
            head = getattr(self, "lm_head", None)
            emb = self.model.embed_tokens
            if head is not None and (emb is None or head.weight is not emb.weight):
                store_k_major(head, pad=True)
        return self

    def to_dtype(self, dtype: torch.dtype) -> HybridForCausalLM:
        for name, p in list(self.named_parameters()) + list(self.named_buffers()):
            if p.is_floating_point():
                p.data = p.data.to(torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype)
        return self

    @property
    def rank_config(self) -> ModelConfig:
        """The shapes this process holds: the config, or a tensor-parallel rank's share of its
        heads (kdaserve/distributed/tensor_parallel.py sets it)."""
        return getattr(self, "_rank_config", None) or self.config

    @property
    def dtype(self) -> torch.dtype:
        # a pipeline stage past the first holds no embedding: any held layer's norm says it
        emb = self.model.embed_tokens
        if emb is not None:
            return emb.weight.dtype
        return next(iter(self.model.layers)).input_layernorm.weight.dtype

    def weight_report(self) -> dict[str, float]:
        """Bytes and weights as loaded: the whole model and the routed experts apart."""
        total = sum(t.numel() * t.element_size() for t in self.state_dict().values())
        expert_bytes = expert_weights = 0
        for layer in self.model.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None:
                b, n = moe.weight_bytes()
                expert_bytes, expert_weights = expert_bytes + b, expert_weights + n
        return {"bytes": total, "expert_bytes": expert_bytes, "expert_weights": expert_weights,
                "expert_bytes_per_weight": expert_bytes / expert_weights if expert_weights
                else 0.0}

    def new_bank(self) -> ResidualBank | None:
        """What a forward carries beside the stream: K3's attention-residual bank; None here."""
        return None

    def run_stage(self, x: torch.Tensor, fb: ForwardBatch, layers: Iterable[int],
                  bank: ResidualBank | None, capture_layers: tuple[int, ...] = (),
                  captured: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Layers `layers` (global indices, in order) over the stream x [T, H]; the stream
        after each layer in capture_layers is appended to `captured`."""
        for i in layers:
            x = self.model.layers[i](x, fb)
            if i in capture_layers:
                captured.append(x)
        return x

    def final_hidden(self, x: torch.Tensor, bank: ResidualBank | None) -> torch.Tensor:
        """The hidden state after the last layer, before model.norm."""
        return x

    def run_layers(self, x: torch.Tensor, fb: ForwardBatch, capture_layers: tuple[int, ...]
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder stack over embeddings x [T, H]: the final hidden (before model.norm)
        and the stream after each layer in capture_layers."""
        bank = self.new_bank()
        captured: list[torch.Tensor] = []
        x = self.run_stage(x, fb, range(self.config.num_hidden_layers), bank, capture_layers,
                           captured)
        return self.final_hidden(x, bank), captured

    def forward(
        self, input_ids: torch.Tensor, fb: ForwardBatch,
        capture_layers: tuple[int, ...] = (), inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [T] packed as described by `fb` (or their embeddings [T, H], images
        already scattered in). Returns logits [S, vocab] (S = rows in fb.logits_indices, or all
        T) and the hidden states after each layer in capture_layers."""
        x = inputs_embeds if inputs_embeds is not None else self.model.embed_tokens(input_ids)
        x, captured = self.run_layers(x, fb, capture_layers)
        if fb.logits_indices is not None:
            x = x[fb.logits_indices]
        return self.lm_head(self.model.norm(x)), captured

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain full-sequence forward of a [B, L] batch (no cache): logits [B, L, vocab]."""
        b, l_ = input_ids.shape
        fb = build_forward_batch([l_] * b, conv_kernel=self.config.conv_kernel_size,
                                 chunk_size=self.chunk_size, device=input_ids.device)
        logits, _ = self.forward(input_ids.reshape(-1), fb)
        return logits.view(b, l_, -1)


def _transposed_experts_read(dtype: torch.dtype) -> bool:
    """Whether a compiled CPU kernel reads experts of this dtype in the transposed layout."""
    if dtype == torch.float32:
        return moe_experts_kernel() is not None
    return dtype == torch.bfloat16 and decode_block_kernels("bf16") is not None
