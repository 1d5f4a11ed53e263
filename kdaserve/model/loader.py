"""Load HF-format checkpoints of the family (safetensors only, never pickles): Kimi
Linear's layout and K3's (`language_model.` prefix, sharded, MXFP4-packed routed experts).
The model class comes from the registry."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from kdaserve.model import ct_checkpoint, fp8_checkpoint
from kdaserve.model.base import FP32_PARAM_SUFFIXES, HybridForCausalLM
from kdaserve.model.checkpoint_files import CheckpointError, checkpoint_files
from kdaserve.model.expert_names import expert_slice as _expert_slice
from kdaserve.model.expert_names import expert_target as _expert_target
from kdaserve.model.quant_linear import QuantLinear
from kdaserve.model.quantize import quantize_model, quantized_layout, widen_unpacked
from kdaserve.model.registry import build_model, load_config, read_config_json
from kdaserve.model.saver import save_model  # noqa: F401 (importers' name for it)
from kdaserve.model.vision.hf_layout import HFLayoutConverter, is_hf_layout
from kdaserve.model.vision.tower import has_vision, vision_config_of
from kdaserve.quant_config import WeightQuant

log = logging.getLogger("kdaserve")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Other spellings of a model tensor's name found in checkpoints: transformers' save_pretrained
# names the dense layer's MLP like the MoE block; attention-residual weights also appear as
# `{point}.norm_weight` / `{point}.proj_weight`; the correction bias also sits on the MoE block.
_ALIASES = (
    (re.compile(r"^((?:language_model\.)?model\.layers\.\d+\.)block_sparse_moe\."
                r"(gate_proj|up_proj|down_proj)\."), r"\1mlp.\2."),
    (re.compile(r"(self_attention_res|mlp_res|output_attn_res)\.(norm|proj)_weight$"),
     r"\1_\2.weight"),
    (re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"),
     ".block_sparse_moe.gate.e_score_correction_bias"),
    # transformers 5.24's default kimi_k25 save misplaces the patch embedding
    (re.compile(r"^vision_tower\.encoder\.patch_embed\."), "vision_tower.patch_embed."),
)
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# Parts of a multimodal or MTP checkpoint a model may not build (logged, not loaded).
_SKIPPED = re.compile(r"^(vision_tower|vision_model|mm_projector|multi_modal_projector)\.|"
                      r"^(language_model\.)?model\.mtp")
# tensors whose checkpoint shape differs from the module's only by singleton dims
_RESHAPEABLE = ("A_log", "dt_bias")


def _read(h, name: str, want: tuple[int, ...] | None, shard, reshapeable: bool) -> torch.Tensor:
    """The checkpoint tensor, or this rank's slice of it when the model holds a share: only
    that slice is read from the file."""
    if shard is None or shard.tp_size == 1 or want is None:
        return h.get_tensor(name)
    sl = h.get_slice(name)
    return _share(sl, tuple(sl.get_shape()), want, shard, name, reshapeable,
                  lambda: h.get_tensor(name))


def _share(src, full: tuple[int, ...], want: tuple[int, ...], shard, name: str,
           reshapeable: bool, whole) -> torch.Tensor:
    """This rank's part of `src` (a safetensors slice or a tensor; `whole()` reads all of it):
    the one dimension whose size differs is split evenly over the tensor-parallel ranks."""
    if full == want:
        return whole()
    tp, r = shard.tp_size, shard.tp_rank
    if len(full) != len(want) and reshapeable:          # A_log [H] vs [1,1,H,1]: tiny
        t = whole().reshape(-1)
        n = t.numel() // tp
        return t[r * n:(r + 1) * n]
    diff = [d for d, (f, w) in enumerate(zip(full, want)) if f != w]
    if len(full) != len(want) or len(diff) != 1 or full[diff[0]] != want[diff[0]] * tp:
        raise CheckpointError(f"tensor '{name}' of shape {full} does not split into this "
                              f"rank's {want} over {tp} ranks")
    d, n = diff[0], want[diff[0]]
    return src[(slice(None),) * d + (slice(r * n, (r + 1) * n),)]


def _held_elsewhere(name: str, foreign: tuple[str, ...]) -> bool:
    return any(n.startswith(foreign) for n in [name] + [p.sub(r, name) for p, r in _ALIASES])


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def checkpoint_has_vision(path: str | os.PathLike) -> bool:
    """Whether the checkpoint's files hold vision-tower tensors (read from the safetensors
    headers, nothing loaded): an engine whose ranks load the model elsewhere asks this."""
    for f in checkpoint_files(Path(path)):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            # ours: vision_tower.*; transformers' kimi_k25: model.vision_tower.*
            if any({"vision_tower", "vision_model"} & set(n.split(".")[:2]) for n in h.keys()):
                return True
    return False


def _canonical(name: str, params: dict[str, torch.Tensor]) -> str:
    if name in params:
        return name
    for pattern, repl in _ALIASES:
        alias = pattern.sub(repl, name)
        if alias in params:
            return alias
    return name


def load_model(
    path: str | os.PathLike, dtype: str | torch.dtype = "float32", device: str = "cpu",
    chunk_size: int = 16, progress: bool = True, parallel=None, moe_backend: str = "auto",
    quantization: WeightQuant | None = None, whole_groups: bool = False,
) -> HybridForCausalLM:
    """Build the model from `path/config.json` and fill it from the safetensors files there.
    `parallel` (a kdaserve.distributed ParallelContext): build this rank's share and read
    only its slices of each tensor. `quantization`: quantize the float weights as they load
    (`--quantization`; `whole_groups` as quantize_model's); a checkpoint stored quantized
    (compressed-tensors) says so itself."""
    path = Path(path)
    cfg = load_config(path)
    wq = cfg.weight_quant
    if (wq is not None or quantization is not None) and parallel is not None:
        raise CheckpointError("INT8/INT4 weights with tensor, expert or pipeline parallelism "
                              "are not supported yet")
    if wq is not None and quantization is not None:
        raise CheckpointError(f"checkpoint {path} is already quantized ({wq.scheme}) and is "
                              "not quantized again: drop --quantization")
    target = parse_dtype(dtype)
    block = fp8_checkpoint.block_size(read_config_json(path))
    fp8 = fp8_checkpoint.FP8Pairs(block) if block is not None else None
    with torch.device("meta"):
        model = build_model(cfg, chunk_size=chunk_size)
        shard = None
        if parallel is not None:
            from kdaserve.distributed.tensor_parallel import shard_model

            shard = shard_model(model, parallel, moe_backend)
        if wq is not None:
            quantized_layout(model, wq, target)
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
    skipped = 0
    vcfg = vision_config_of(cfg) if cfg.architecture == "kimi_k25" else None
    hf_layout = HFLayoutConverter(vcfg.num_attention_heads) if vcfg is not None else None
    for h, raw_name in bar:
        if _IGNORED.search(raw_name):
            continue
        if hf_layout is not None and is_hf_layout(raw_name):
            pieces = hf_layout.feed(raw_name, h.get_tensor(raw_name))
        elif fp8 is not None:
            pieces = fp8.feed(raw_name, h)
        else:
            pieces = [(raw_name, None)]
        for name, t in pieces:
            if name.endswith(ct_checkpoint.SHAPE_SUFFIX):
                ct_checkpoint.check_shape(name, h.get_tensor(name), params, wq)
                continue
            skipped += _load_one(name, t if t is not None else h, params, loaded, filled,
                                 target, device, path, shard, wq, quantization is not None)
    if fp8 is not None:
        fp8.finish()
    if hf_layout is not None:
        try:
            hf_layout.finish()
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path}: {e}") from None
    _check_experts(filled, params, path)
    if has_vision(model) and not any(k.startswith("vision_tower.") for k in loaded):
        log.info("kdaserve: %s has no vision weights; serving text only", path)
        model.drop_vision()
        params = {k: v for k, v in params.items()
                  if not k.startswith(("vision_tower.", "mm_projector."))}
    if skipped:
        log.info("kdaserve: %d vision/MTP tensors in %s are not part of the model; "
                 "not loaded", skipped, path)
    # (a pipeline stage may hold only one of the two)
    head, emb = getattr(model, "lm_head", None), model.model.embed_tokens
    tied = cfg.tie_word_embeddings and not isinstance(head, QuantLinear)
    if tied and "lm_head.weight" not in loaded and head is not None:
        loaded["lm_head.weight"] = loaded.get("model.embed_tokens.weight")
    missing = sorted(k for k in params if k not in loaded or loaded[k] is None)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {path} lacks tensor(s) {missing[:5]}{more}")
    model.load_state_dict(loaded, strict=True, assign=True)
    loaded.clear()          # the model holds them now: each float weight goes as it is packed
    if tied and head is not None and emb is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    if quantization is not None:
        quantize_model(model, quantization, whole_groups, dtype=target)
        widen_unpacked(model, target)
    return model.eval()


def _load_one(name: str, src, params: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor],
              filled: dict[str, set[tuple[int, str]]], target: torch.dtype, device: str,
              path: Path, shard=None, wq: WeightQuant | None = None,
              narrow: bool = False) -> int:
    """Place one checkpoint tensor (`src`: the tensor, or the safetensors handle to read it
    from) into `loaded`; returns 1 when it was skipped as not part of the model. With a
    `shard` (a parallel layout), only this rank's experts and slices are read. `narrow`
    (quantized on load): a float stored narrower than `target` stays so (load_model widens
    what is left unpacked), so a bf16 checkpoint is never all in fp32 at once."""
    if _SKIPPED.search(name) and _canonical(name, params) not in params:
        return 1
    if shard is not None and shard.foreign and _held_elsewhere(name, shard.foreign):
        return 0                 # another pipeline stage's tensor: not read here
    expert = _expert_target(name)
    key = expert[0] if expert else _canonical(name, params)
    if key not in params:
        raise CheckpointError(f"unexpected tensor '{name}' in checkpoint {path}")
    if expert is not None and shard is not None:    # expert parallel: ours only
        e_local = expert[1] - shard.expert_start
        if not 0 <= e_local < shard.num_local_experts:
            return 0
        expert = (expert[0], e_local, expert[2])
    want_shape = (tuple(params[key].shape) if expert is None else
                  tuple(_expert_slice(params[key], expert[1], expert[2]).shape)
                  if expert[1] < params[key].shape[0] else None)
    if not isinstance(src, torch.Tensor):
        t = _read(src, name, want_shape, shard, key.endswith(_RESHAPEABLE))
    elif shard is not None and shard.tp_size > 1 and want_shape is not None:
        # converted from another layout (kimi_k25's HF names) in memory: cut the share here
        t = _share(src, tuple(src.shape), want_shape, shard, name, key.endswith(_RESHAPEABLE),
                   lambda: src)
    else:
        t = src
    t = ct_checkpoint.stored_form(name, t, want_shape[0] if want_shape else None, wq)
    keep32 = key.endswith(FP32_PARAM_SUFFIXES)
    dtype = params[key].dtype if not params[key].is_floating_point() else (
        torch.float32 if keep32 else target)
    if narrow and not keep32 and t.is_floating_point() and t.dtype.itemsize < dtype.itemsize:
        dtype = t.dtype
    if t.is_floating_point() != params[key].is_floating_point():
        raise CheckpointError(f"tensor '{name}' is {t.dtype}, expected "
                              f"{params[key].dtype} (is the quantization_config right?)")
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
        return 0
    want = tuple(params[key].shape)
    if key.endswith(_RESHAPEABLE) and t.numel() == params[key].numel():
        t = t.reshape(want)
    if tuple(t.shape) != want:
        raise CheckpointError(
            f"tensor '{name}' has shape {tuple(t.shape)}, expected {want} from config.json"
        )
    loaded[key] = t.to(device=device, dtype=dtype)
    return 0


def _check_experts(filled: dict[str, set[tuple[int, str]]], params: dict[str, torch.Tensor],
                   path: Path) -> None:
    for key, parts in filled.items():
        stack = key.rsplit(".", 1)[1]
        want = {(e, p) for e in range(params[key].shape[0])
                for p in (("w2",) if stack.startswith("experts_w2") else ("w1", "w3"))}
        if parts != want:
            e, part = min(want - parts)
            prefix = key.rsplit(".", 1)[0]
            kind = ("weight_packed" if stack.endswith("_packed") else
                    "weight_scale" if stack.endswith("_scale") else "weight")
            raise CheckpointError(
                f"checkpoint {path} lacks tensor '{prefix}.experts.{e}.{part}.{kind}'")
