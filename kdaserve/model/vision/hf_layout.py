"""transformers' in-memory Kimi K2.5 layout -> the released checkpoint names kdaserve builds.

`Kimi_K25ForConditionalGeneration.save_pretrained(save_original_format=False)` writes the
module names transformers uses at run time: `model.language_model.*` (kimi_linear with its
fused conv, `forget_gate`, stacked `mlp.experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`),
`model.vision_tower.layers.{i}.attn.{q,k,v}_proj` (rotary rows permuted to split halves),
`model.mm_projector.{pre_norm,in_proj,out_proj}` and a top-level `lm_head`. Its default save
(`save_original_format=True`) mangles the kimi_linear text weights in 5.24 (the vision rules
rename `attn.q_proj` inside the text layers too, and transformers cannot load that file
back), so the unconverted layout is the one to read.
"""

from __future__ import annotations

import re

import torch

_PREFIXES = ("model.language_model.", "model.vision_tower.", "model.mm_projector.")
_VISION_RENAMES = (
    (re.compile(r"^layers\.(\d+)\.norm1\."), r"encoder.blocks.\1.norm0."),
    (re.compile(r"^layers\.(\d+)\.norm2\."), r"encoder.blocks.\1.norm1."),
    (re.compile(r"^layers\.(\d+)\.mlp\.fc1\."), r"encoder.blocks.\1.mlp.fc0."),
    (re.compile(r"^layers\.(\d+)\.mlp\.fc2\."), r"encoder.blocks.\1.mlp.fc1."),
    (re.compile(r"^layers\.(\d+)\.attn\.proj\."), r"encoder.blocks.\1.wo."),
    (re.compile(r"^final_layernorm\."), "encoder.final_layernorm."),
    (re.compile(r"^patch_embed\.pos_emb\.position_embeddings$"), "patch_embed.pos_emb.weight"),
)
_QKV = re.compile(r"^layers\.(\d+)\.attn\.(q|k|v)_proj\.(weight|bias)$")
_PROJ = {"pre_norm": "pre_norm", "in_proj": "proj.0", "out_proj": "proj.2"}


def is_hf_layout(name: str) -> bool:
    return name.startswith(_PREFIXES) or name == "lm_head.weight"


def interleave_rope_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Split-halves rotary rows (transformers) -> interleaved pairs (released checkpoints)."""
    n = t.shape[0]
    return t.reshape(heads, 2, n // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


class HFLayoutConverter:
    """Feed tensors one by one; q/k/v of a vision block come out as one `wqkv` once all
    three arrived. `finish()` names any group left incomplete."""

    def __init__(self, vision_heads: int) -> None:
        self.heads = vision_heads
        self._qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def feed(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name == "lm_head.weight":
            return [("language_model.lm_head.weight", t)]
        if name.startswith("model.language_model."):
            return self._text("language_model.model." + name[len("model.language_model."):], t)
        if name.startswith("model.mm_projector."):
            part, rest = name[len("model.mm_projector."):].split(".", 1)
            return [(f"mm_projector.{_PROJ.get(part, part)}.{rest}", t)]
        return self._vision(name[len("model.vision_tower."):], t)

    def finish(self) -> None:
        if self._qkv:
            (block, kind), got = next(iter(self._qkv.items()))
            raise ValueError(f"vision block {block}: attn {kind} lacks "
                             f"{sorted({'q', 'k', 'v'} - set(got))} projection(s)")

    def _vision(self, rest: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        m = _QKV.match(rest)
        if m is None:
            for pattern, repl in _VISION_RENAMES:
                rest = pattern.sub(repl, rest)
            return [("vision_tower." + rest, t)]
        block, which, kind = m.groups()
        group = self._qkv.setdefault((block, kind), {})
        group[which] = interleave_rope_rows(t, self.heads) if which in "qk" else t
        if len(group) < 3:
            return []
        del self._qkv[(block, kind)]
        fused = torch.cat([group["q"], group["k"], group["v"]])
        return [(f"vision_tower.encoder.blocks.{block}.wqkv.{kind}", fused)]

    @staticmethod
    def _text(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        name = name.replace(".self_attn.forget_gate.", ".self_attn.")
        if name.endswith(".self_attn.conv1d.weight"):
            base = name[: -len("conv1d.weight")]
            return [(f"{base}{p}_conv1d.weight", c) for p, c in zip("qkv", t.chunk(3))]
        if ".mlp.experts." in name:
            base = name.split(".mlp.experts.")[0] + ".block_sparse_moe.experts"
            if name.endswith("gate_up_proj"):
                inter = t.shape[1] // 2
                return [piece for e in range(t.shape[0]) for piece in (
                    (f"{base}.{e}.w1.weight", t[e, :inter]),
                    (f"{base}.{e}.w3.weight", t[e, inter:]))]
            return [(f"{base}.{e}.w2.weight", t[e]) for e in range(t.shape[0])]
        name = re.sub(r"\.mlp\.(gate|shared_experts)\.", r".block_sparse_moe.\1.", name)
        return [(name, t)]
