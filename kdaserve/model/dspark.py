"""The DSpark-style block drafter: a few dense MLA decoder layers fed by the target's hidden states.

Its context is not tokens: the target's hidden states after `target_layer_ids`, concatenated,
go through `context_proj` + norm, and each draft layer's kv_a projection turns them into that
layer's MLA latents (cached in pages, like the target's). One forward drafts a block of k query
positions per request: the last accepted token followed by k-1 mask embeddings, attending to the
context and, non-causally, to each other. Tokens are then picked left to right with a low-rank
Markov bias from the previous token. Only the target's embedding and LM head are shared.

Two checkpoint layouts, one module: `dspark_draft` (this project's; own mask embedding) and
`k3_dspark` (the released Kimi-K3-DSpark: the mask is the target's embedding of `mask_token_id`,
MLA with q-LoRA and interleaved YaRN RoPE, `final_norm`, `markov_head.markov_w1/markov_w2`;
its `embed_tokens` copy and `confidence_head` are not used for serving and not loaded).

Legend: B requests, Q query positions, L context positions, H hidden, D latent width, V vocab.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kdaserve.model.checkpoint_files import checkpoint_files
from kdaserve.model.layers import MLP, RMSNorm, embedding
from kdaserve.model.mla import MultiHeadLatentAttention
from kdaserve.ops.mla import mla_absorbed

MODEL_TYPE = "dspark_draft"
K3_MODEL_TYPE = "k3_dspark"
# the released K3 DSpark's names for modules this class names otherwise
_K3_NAMES = (("final_norm.", "norm."), ("markov_head.markov_w1.", "markov_in."),
             ("markov_head.markov_w2.", "markov_out."))
_K3_UNUSED = ("embed_tokens.", "confidence_head.")
# config.json fields of k3_dspark that change nothing here
_K3_IGNORED = frozenset({
    "architectures", "model_type", "draft_vocab_size", "num_target_layers", "target_hidden_size",
    "target_num_hidden_layers", "markov_head_type", "enable_confidence_head",
    "confidence_head_with_markov", "max_position_embeddings", "hidden_act", "num_key_value_heads",
    "mla_use_output_gate", "rope_parameters", "rope_scaling", "dflash_config", "torch_dtype",
    "dtype", "transformers_version", "aux_hidden_stream", "fc_norm", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "attention_dropout",
    "initializer_range", "use_cache",
})


@dataclass(frozen=True)
class DraftConfig:
    """Field names follow the target's ModelConfig, so the MLA module reads either."""

    hidden_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 512
    block_size: int = 8
    markov_rank: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    q_lora_rank: int | None = None
    mla_use_nope: bool = False
    extra: dict = field(default_factory=dict)
    layout: str = MODEL_TYPE                    # dspark_draft | k3_dspark
    mask_token_id: int | None = None            # k3_dspark: mask = target embedding of this id
    rope_interleaved: bool = False
    rope_scaling: dict | None = None
    # this project's drafts only: the block's inputs shifted by the request's temperature,
    # read up to the highest temperature the draft was trained at (hotter requests read that)
    temperature_conditioning: bool = False
    max_conditioning_temperature: float = 1.0
    # the most context positions (the newest) a drafted block attends to; None: all of them.
    # This project's drafts are trained on sequences of a few hundred tokens, and their
    # rotary queries and keys never met farther apart than that
    context_window: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        if self.layout == K3_MODEL_TYPE:
            for k in ("layout", "extra", "rope_interleaved", "rope_scaling",
                      "temperature_conditioning", "max_conditioning_temperature"):
                d.pop(k)
            if d["context_window"] is None:     # this project's field: written only when set
                d.pop("context_window")
            rope = dict(self.rope_scaling or {"rope_type": "default"})
            rope["rope_theta"] = self.rope_theta
            return {"model_type": K3_MODEL_TYPE, "architectures": ["K3DSparkModel"], **d,
                    "num_key_value_heads": self.num_attention_heads,
                    "mla_use_output_gate": False, "rope_parameters": rope,
                    "markov_head_type": "vanilla", "enable_confidence_head": False}
        return {"model_type": MODEL_TYPE, **d}

    @classmethod
    def from_dict(cls, raw: dict) -> DraftConfig:
        mt = raw.get("model_type")
        if mt == K3_MODEL_TYPE:
            return cls._from_k3(raw)
        if mt != MODEL_TYPE:
            raise ValueError(f"not a DSpark draft config (model_type {mt!r}; supported "
                             f"{MODEL_TYPE}, {K3_MODEL_TYPE})")
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        known["target_layer_ids"] = tuple(known["target_layer_ids"])
        return cls(**known)

    @classmethod
    def _from_k3(cls, raw: dict) -> DraftConfig:
        """The released k3_dspark config.json (no block size there: the released draft was
        trained with blocks of 7; `block_size` or `dflash_config.block_size` override it)."""
        unknown = sorted(set(raw) - _K3_IGNORED - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"k3_dspark config: unknown field(s) {unknown}")
        if raw.get("mla_use_output_gate"):
            raise ValueError("k3_dspark config: an output-gated draft MLA is not supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        scaling = None if rope.get("rope_type", rope.get("type", "default")) == "default" \
            else {k: v for k, v in rope.items() if k != "rope_theta"}
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        known.update(
            target_layer_ids=tuple(raw["target_layer_ids"]), layout=K3_MODEL_TYPE,
            block_size=int(raw.get("block_size") or (raw.get("dflash_config") or {}).get(
                "block_size") or 7),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_interleaved=True, rope_scaling=scaling,
            mla_use_nope=bool(raw.get("mla_use_nope", False)))
        if known.get("mask_token_id") is None:
            raise ValueError("k3_dspark config: 'mask_token_id' is required")
        return cls(**known)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(cfg, 0)  # type: ignore[arg-type]
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [B,Q,H] block rows at positions [B,Q]; ctx [B,L,D] this layer's context latents;
        mask [B,Q,L+Q]: what each query may see of context then block."""
        attn = self.self_attn
        b, q_len, hid = x.shape
        h = self.input_layernorm(x).reshape(b * q_len, hid)
        flat_pos = positions.reshape(-1)
        q = attn.queries(h)                                                   # [BQ,heads,N+R]
        q_pe = q[..., attn.nope:]
        if attn.use_rope and attn.rope:
            q_pe = attn.rotate(q_pe, flat_pos)
        own = attn.latents(h, flat_pos).view(b, q_len, -1)                     # [B,Q,D]
        keys = torch.cat([ctx.to(own.dtype), own], 1)                          # [B,L+Q,D]
        w_uk, w_uv = attn.absorbed_weights()
        o = mla_absorbed(q[..., : attn.nope].view(b, q_len, attn.num_heads, attn.nope),
                         q_pe.reshape(b, q_len, attn.num_heads, -1), keys, mask, w_uk, w_uv,
                         attn.scale)
        x = x + attn.o_proj(o.reshape(b, q_len, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkDraft(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        hid = cfg.hidden_size
        self.context_proj = nn.Linear(hid * len(cfg.target_layer_ids), hid, bias=False)
        self.context_norm = RMSNorm(hid, cfg.rms_norm_eps)
        if cfg.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.zeros(hid))
        else:   # the target's embedding of the mask token: set by bind_target
            self.register_buffer("mask_embedding", torch.full((hid,), float("nan")),
                                 persistent=False)
        if cfg.temperature_conditioning:
            # rows e0, e1: a request sampled at temperature T adds e0 + T e1 to its block's
            # inputs (greedy: T 0), so one draft fits both greedy and sampled verification
            self.temperature_embedding = nn.Parameter(torch.zeros(2, hid))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(hid, cfg.rms_norm_eps)
        self.markov_in = embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_out = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        nn.init.zeros_(self.markov_out.weight)

    # ---- the pieces inference and training share ------------------------------------------
    def context_latents(self, hidden: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Target hidden states [T, n*H] at positions [T] -> each draft layer's latents [T, D]."""
        c = self.context_norm(self.context_proj(hidden.to(self.context_proj.weight.dtype)))
        return [layer.self_attn.latents(c, positions) for layer in self.layers]

    def block_hidden(self, first: torch.Tensor, positions: torch.Tensor,
                     ctx: list[torch.Tensor], mask: torch.Tensor, block: int,
                     temperatures: torch.Tensor | None = None) -> torch.Tensor:
        """first [B,Q/block,H]: embeddings of each block's first token; the rest of every block
        is mask embeddings. positions [B,Q]; ctx per layer [B,L,D]; mask [B,Q,L+Q];
        temperatures [B] each row's sampling temperature (0: greedy), read by a
        temperature-conditioned draft only (None there: greedy)."""
        b, nb, hid = first.shape
        x = torch.cat([first[:, :, None], self.mask_embedding.to(first.dtype).expand(
            b, nb, block - 1, hid)], 2).reshape(b, nb * block, hid)
        if self.config.temperature_conditioning:
            e = self.temperature_embedding
            t = (torch.zeros(b, device=x.device) if temperatures is None else
                 temperatures.clamp(0.0, self.config.max_conditioning_temperature))
            x = x + (e[0] + t.to(e.dtype)[:, None] * e[1]).to(x.dtype)[:, None]
        for layer, lat in zip(self.layers, ctx):
            x = layer(x, positions, lat, mask)
        return self.norm(x)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """[...] previous tokens -> [..., V] additive logits."""
        return self.markov_out(self.markov_in(prev))

    def bind_target(self, embed: nn.Module) -> None:
        """Share what the target owns: for the K3 layout, the mask token's embedding. Read
        through the target's embedding module, not its weight: under tensor parallelism the
        table is split by vocabulary and the module gathers the row (every rank calls this)."""
        if self.config.mask_token_id is not None:
            ids = torch.tensor([self.config.mask_token_id], device=self.mask_embedding.device)
            with torch.no_grad():
                self.mask_embedding.copy_(embed(ids)[0].detach())

    # ---- files ------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.config.layout == K3_MODEL_TYPE:
            state = {_rename(k, [(b, a) for a, b in _K3_NAMES]): v for k, v in state.items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> DSparkDraft:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no draft model at {path} (config.json missing)")
        cfg = DraftConfig.from_dict(json.loads((path / "config.json").read_text()))
        model = cls(cfg)
        state = {}
        for f in checkpoint_files(path):
            state.update(load_file(str(f)))
        if cfg.layout == K3_MODEL_TYPE:
            state = {_rename(k.removeprefix("model."), _K3_NAMES): v for k, v in state.items()
                     if not k.removeprefix("model.").startswith(_K3_UNUSED)}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"draft checkpoint {path}: missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}")
        return model.to(device=device, dtype=dtype).eval()


def _rename(name: str, pairs) -> str:
    for old, new in pairs:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def training_mask(ctx_len: int, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """anchors [B,A] block start positions -> mask [B, A*block, ctx_len + A*block]: a block's
    queries see the context before its anchor and every position of their own block."""
    b, a = anchors.shape
    q_anchor = anchors.repeat_interleave(block, 1)                              # [B,Q]
    ctx_ok = torch.arange(ctx_len, device=anchors.device)[None, None] < q_anchor[..., None]
    blk = torch.arange(a, device=anchors.device).repeat_interleave(block)
    same = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    return torch.cat([ctx_ok, same], -1)
