"""Load and save HF-format Kimi Linear checkpoints (safetensors only, never pickles)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from kdaserve.config import ModelConfig
from kdaserve.model.kimi_linear import FP32_PARAM_SUFFIXES, KimiLinearForCausalLM


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, unexpected, or of the wrong shape."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# transformers' save_pretrained names the dense layer's MLP like the MoE block.
_DENSE_ALIAS = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate_proj|up_proj|down_proj)\.")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# Routed experts are stored stacked in the model; the checkpoint names them one by one.
_EXPERT = re.compile(r"^(.*\.block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def _expert_target(name: str) -> tuple[str, int, str] | None:
    """`...experts.{e}.w1.weight` -> (stacked parameter name, e, part)."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    stacked = f"{m.group(1)}.experts_w2" if m.group(3) == "w2" else f"{m.group(1)}.experts_w13"
    return stacked, int(m.group(2)), m.group(3)


def _expert_slice(t: torch.Tensor, e: int, part: str) -> torch.Tensor:
    """The view of stacked tensor `t` that holds expert e's `part`."""
    if part == "w2":
        return t[e]
    half = t.shape[1] // 2
    return t[e, :half] if part == "w1" else t[e, half:]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that do not exist: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no safetensors weights in {path} (looked for model.safetensors, "
            "model.safetensors.index.json, *.safetensors); pickled checkpoints are not loaded"
        )
    return files


def _canonical(name: str, params: dict[str, torch.Tensor]) -> str:
    if name in params:
        return name
    alias = _DENSE_ALIAS.sub(r"\1mlp.\2.", name)
    return alias


def load_model(
    path: str | os.PathLike, dtype: str | torch.dtype = "float32", device: str = "cpu",
    chunk_size: int = 16, progress: bool = True,
) -> KimiLinearForCausalLM:
    """Build the model from `path/config.json` and fill it from the safetensors files there."""
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg, chunk_size=chunk_size)
    target = parse_dtype(dtype)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    loaded: dict[str, torch.Tensor] = {}
    files = checkpoint_files(path)
    names = []
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    for h in handles:
        names.extend((h, n) for n in h.keys())
    bar = tqdm(names, desc="Loading weights", unit="tensor", disable=not progress)
    filled: dict[str, set[tuple[int, str]]] = {}
    for h, name in bar:
        if _IGNORED.search(name):
            continue
        expert = _expert_target(name)
        key = expert[0] if expert else _canonical(name, params)
        if key not in params:
            raise CheckpointError(f"unexpected tensor '{name}' in checkpoint {path}")
        t = h.get_tensor(name)
        keep32 = key.endswith(FP32_PARAM_SUFFIXES)
        dtype = torch.float32 if keep32 else target
        if expert is not None:
            _, e, part = expert
            if e >= params[key].shape[0]:
                raise CheckpointError(f"tensor '{name}': expert {e} beyond num_experts")
            if key not in loaded:
                loaded[key] = torch.empty(params[key].shape, dtype=dtype, device=device)
            dst = _expert_slice(loaded[key], e, part)
            if tuple(t.shape) != tuple(dst.shape):
                raise CheckpointError(
                    f"tensor '{name}' has shape {tuple(t.shape)}, expected {tuple(dst.shape)} "
                    "from config.json")
            dst.copy_(t)
            filled.setdefault(key, set()).add((e, part))
            continue
        want = tuple(params[key].shape)
        if tuple(t.shape) != want:
            raise CheckpointError(
                f"tensor '{name}' has shape {tuple(t.shape)}, expected {want} from config.json"
            )
        loaded[key] = t.to(device=device, dtype=dtype)
    for key, parts in filled.items():
        want = {(e, p) for e in range(params[key].shape[0])
                for p in (("w2",) if key.endswith("experts_w2") else ("w1", "w3"))}
        if parts != want:
            e, part = min(want - parts)
            prefix = key.rsplit(".", 1)[0]
            raise CheckpointError(f"checkpoint {path} lacks tensor '{prefix}.experts.{e}.{part}.weight'")
    if cfg.tie_word_embeddings and "lm_head.weight" not in loaded:
        loaded["lm_head.weight"] = loaded.get("model.embed_tokens.weight")
    missing = sorted(k for k in params if k not in loaded or loaded[k] is None)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {path} lacks tensor(s) {missing[:5]}{more}")
    model.load_state_dict(loaded, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def save_model(model: KimiLinearForCausalLM, out: str | os.PathLike,
               dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors with the released checkpoint's names."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach()
        if dtype is not None and t.is_floating_point() and not name.endswith(FP32_PARAM_SUFFIXES):
            t = t.to(dtype)
        for out_name, piece in _checkpoint_pieces(name, t):
            piece = piece.contiguous().cpu()
            if piece.untyped_storage().nbytes() != piece.nbytes:  # a view (fused weights)
                piece = piece.clone()
            state[out_name] = piece
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = model.config.to_hf_dict()
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)


def _checkpoint_pieces(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A model tensor under the released checkpoint's names (stacked experts split apart)."""
    for suffix, parts in ((".experts_w13", ("w1", "w3")), (".experts_w2", ("w2",))):
        if name.endswith(suffix):
            prefix = name[: -len(suffix)]
            return [(f"{prefix}.experts.{e}.{p}.weight", _expert_slice(t, e, p))
                    for e in range(t.shape[0]) for p in parts]
    return [(name, t)]
