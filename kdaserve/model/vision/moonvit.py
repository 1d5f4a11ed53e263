"""MoonViT: the Kimi vision encoder, at native resolution over packed patches.

Legend: N patches of all images packed, D vision width, A attention width (D unless
`qkv_hidden_size`), h heads of d = A/h, M merged tokens (N / 4 with 2x2 merging).

An image of grid (gh, gw) patches (raster order) gets the learned [Hp, Wp, D] position table
resampled to (gh, gw) (bicubic, or bilinear for V2; the table itself when the sizes agree) and a
2D rotary embedding: in each head, rotation pair p = 2i turns by col·θ_i and p = 2i+1 by row·θ_i,
θ_i = theta^(-4i/d), pairs interleaved as the released checkpoints store `wqkv` (transformers
permutes the q/k rows to split halves on load; the loader converts that layout back). Attention
is bidirectional within one image, never across images. After the final norm each 2x2 block of
patches becomes one token of 4·D features, the projector's input.

Parameter names are the released checkpoints' (`vision_tower.patch_embed.proj`,
`vision_tower.patch_embed.pos_emb.weight`, `vision_tower.encoder.blocks.{i}.{norm0, norm1,
wqkv, wo, mlp.fc0, mlp.fc1}`, `vision_tower.encoder.final_layernorm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.model.vision.config import VisionConfig


def make_norm(cfg: VisionConfig, dim: int) -> nn.Module:
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps)


class PositionEmbedding(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.mode = cfg.pos_interp_mode
        self.weight = nn.Parameter(torch.zeros(cfg.pos_emb_height, cfg.pos_emb_width,
                                               cfg.hidden_size))

    def grid(self, gh: int, gw: int) -> torch.Tensor:
        """The table resampled to (gh, gw): [gh·gw, D] in raster order."""
        w = self.weight
        if (gh, gw) != tuple(w.shape[:2]):
            w = F.interpolate(w.permute(2, 0, 1).unsqueeze(0).float(), size=(gh, gw),
                              mode=self.mode, align_corners=False)[0].permute(1, 2, 0)
        return w.reshape(gh * gw, -1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p,
                              bias=cfg.patch_embed_bias)
        self.pos_emb = PositionEmbedding(cfg)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """pixels [N, 3, p, p] -> [N, D]: one patch per row, so the convolution is a matmul."""
        w = self.proj.weight
        x = F.linear(pixels.reshape(pixels.shape[0], -1).to(w.dtype), w.reshape(w.shape[0], -1),
                     self.proj.bias)
        pos = torch.cat([self.pos_emb.grid(gh, gw) for gh, gw in grids])
        return x + pos.to(x.dtype)


def rope_angles(grids: list[tuple[int, int]], head_dim: int, theta: float,
                device: torch.device) -> torch.Tensor:
    """Rotation angles [N, d/2] (fp32) of each patch's pairs: (col, row) interleaved."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, device=device,
                                       dtype=torch.float32) / (head_dim // 2))   # [d/4]
    out = []
    for gh, gw in grids:
        idx = torch.arange(gh * gw, device=device)
        rows, cols = (idx // gw).float(), (idx % gw).float()
        out.append(torch.stack([cols[:, None] * inv, rows[:, None] * inv], -1).flatten(1))
    return torch.cat(out)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [N, h, d] with interleaved pairs rotated by angles [N, d/2] (in fp32)."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.linear_bias)
        self.fc1 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.linear_bias)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.norm0 = make_norm(cfg, cfg.hidden_size)
        self.norm1 = make_norm(cfg, cfg.hidden_size)
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.attn_width, bias=cfg.attn_bias)
        self.wo = nn.Linear(cfg.attn_width, cfg.hidden_size, bias=cfg.attn_bias)
        self.mlp = MLP(cfg)

    def attention(self, x: torch.Tensor, angles: torch.Tensor, lens: list[int]) -> torch.Tensor:
        q, k, v = self.wqkv(x).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        outs = []
        for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens)):   # one image each
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1),
                                               vi.transpose(0, 1))
            outs.append(o.transpose(0, 1).reshape(qi.shape[0], -1))
        return self.wo(torch.cat(outs))

    def forward(self, x: torch.Tensor, angles: torch.Tensor, lens: list[int]) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), angles, lens)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = make_norm(cfg, cfg.hidden_size)


class MoonViT(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """pixels [N, 3, p, p] of the images of `grids` (gh, gw) packed in order -> merged
        patch features [M, kh·kw, D] (each image's merged tokens in raster order)."""
        cfg = self.cfg
        x = self.patch_embed(pixels, grids)
        angles = rope_angles(grids, cfg.head_dim, cfg.rope_theta, x.device)
        lens = [gh * gw for gh, gw in grids]
        for block in self.encoder.blocks:
            x = block(x, angles, lens)
        x = self.encoder.final_layernorm(x)
        kh, kw = cfg.merge_kernel
        merged = []
        for xi, (gh, gw) in zip(x.split(lens), grids):
            t = xi.view(gh // kh, kh, gw // kw, kw, -1).permute(0, 2, 1, 3, 4)
            merged.append(t.reshape(-1, kh * kw, xi.shape[-1]))
        return torch.cat(merged)
