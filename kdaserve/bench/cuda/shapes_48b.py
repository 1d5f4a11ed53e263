"""The `shapes48b` section: decode on a model with Kimi-Linear-48B-A3B's shapes (its
config.json, shipped beside this file) and random bf16 weights made on the device (no
checkpoint on disk): TPOT at several batch sizes, the bytes one decode step reads (weights and
cache), and how much of the GPU's memory bandwidth that is at batch 1 (`hbm_utilization`).
All 27 layers when they fit in the device's memory, the first layers when not. With `--tiny`
(the CPU tests) the bundled Kimi Linear demo's shapes stand in.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

from kdaserve.bench.cuda.driver import drive, error_row, free_memory, median, random_prompts
from kdaserve.bench.cuda.workload import MODELS, Sizes

# the published config (shared/data), shipped with the planner
CONFIG_48B = Path(__file__).parents[2] / "plan" / "configs" / "kimi-linear-48b.json"
# peak memory bandwidth by device name (bytes/s), for the roofline
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12, "GB200": 8.0e12,
                  "B300": 8.0e12, "GB300": 8.0e12, "A100": 2.0e12}
MEMORY_SHARE = 0.75          # of the device's free memory, at most, for the weights


def peak_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in sorted(PEAK_BANDWIDTH.items(), key=lambda kv: -len(kv[0]))
                 if key in name), None)


def first_layers(raw: dict, n: int) -> dict:
    """The config cut to its first n decoder layers (at least one MLA layer kept)."""
    lac = dict(raw["linear_attn_config"])
    full = [x for x in lac["full_attn_layers"] if x <= n] or [n]
    lac["full_attn_layers"] = full
    lac["kda_layers"] = [x for x in range(1, n + 1) if x not in full]
    return {**raw, "num_hidden_layers": n, "linear_attn_config": lac}


def _param_bytes(raw: dict, dtype: torch.dtype) -> tuple[int, int]:
    """(all weights, routed experts) in bytes, from the shapes alone."""
    from kdaserve.model.registry import build_model, load_config

    with torch.device("meta"):
        model = build_model(load_config(raw))
    total = routed = 0
    for name, p in model.named_parameters():
        size = p.numel() * dtype.itemsize
        total += size
        if ".experts_w" in name:
            routed += size
    return total, routed


@contextmanager
def _default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def random_model(raw: dict, device: torch.device, dtype: torch.dtype, chunk: int):
    """Random weights made on the device, in `dtype` but for the parameters kept in fp32."""
    from kdaserve.model.base import FP32_PARAM_SUFFIXES
    from kdaserve.model.registry import build_model, load_config

    g = torch.Generator(device=device).manual_seed(0)
    with torch.device(device), _default_dtype(dtype), torch.no_grad():
        model = build_model(load_config(raw), chunk_size=chunk)
        for name, p in model.named_parameters():
            if name.endswith(FP32_PARAM_SUFFIXES):
                p.data = p.data.float()
            if name.endswith("A_log"):
                p.uniform_(0, 1.5, generator=g)
            elif p.dim() >= 2:
                p.normal_(0, 0.02, generator=g)
            else:
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.02, generator=g)
    return model.eval()


def step_bytes(raw: dict, dtype: torch.dtype, batch: int, context: int, dense: int,
               routed: int) -> int:
    """What one decode step reads: every weight but the routed experts and the embedding
    table, the routed experts the batch is expected to touch (E (1 - (1 - k/E)^b) of E per
    layer, uniform routing), the embedding rows of its tokens, each row's KDA states (read and
    written, fp32) and its MLA latents."""
    h, vocab = raw["hidden_size"], raw["vocab_size"]
    e, k = raw["num_experts"], raw["num_experts_per_token"]
    lac = raw["linear_attn_config"]
    size = dtype.itemsize
    touched = e * (1 - (1 - k / e) ** batch)
    weights = dense - vocab * h * size + batch * h * size + routed * touched / e
    kda = len(lac["kda_layers"]) * lac["num_heads"] * lac["head_dim"] ** 2 * 4 * 2
    mla = len(lac["full_attn_layers"]) * context * (raw["kv_lora_rank"]
                                                     + raw["qk_rope_head_dim"]) * size
    return int(weights + batch * (kda + mla))


def shapes_48b(device: torch.device, sizes: Sizes, tiny: bool = False) -> dict:
    from kdaserve.engine.args import EngineArgs
    from kdaserve.engine.core import EngineCore
    from kdaserve.model.registry import read_config_json

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    raw = read_config_json(MODELS["kimi_linear"]) if tiny else json.loads(
        CONFIG_48B.read_text(encoding="utf-8"))
    full_layers = raw["num_hidden_layers"]
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] * MEMORY_SHARE
        per_layer = _param_bytes(first_layers(raw, 2), dtype)[0] / 2
        raw = first_layers(raw, max(2, min(full_layers, int(budget // per_layer))))
    total, routed = _param_bytes(raw, dtype)
    out: dict = {"config": "bundled Kimi Linear demo" if tiny else "Kimi-Linear-48B-A3B",
                 "layers": raw["num_hidden_layers"], "of_layers": full_layers,
                 "dtype": str(dtype).removeprefix("torch."), "weight_bytes": total,
                 "routed_expert_bytes": routed, "graphs_vs_eager": None,
                 "graphs": device.type == "cuda"}
    batches = (1, 2) if tiny else (1, 8, 32, 64)
    prompt_len, new = (8, 4) if tiny else (256, 64)
    model = random_model(raw, device, dtype, 64 if device.type == "cuda" else 16)
    args = EngineArgs.from_kwargs(
        "bench", device=str(device), dtype=str(dtype).removeprefix("torch."),
        max_num_seqs=max(batches), max_model_len=prompt_len + new + 16,
        enable_prefix_caching=False,
        **({"cache_memory": 256 << 20} if device.type != "cuda" else {}))
    eng = EngineCore(args.to_engine_config(), model=model)
    try:
        shim = SimpleNamespace(engine=eng)
        vocab = raw["vocab_size"]
        drive(shim, random_prompts(max(batches), prompt_len, vocab, 0), 2)      # warm-up
        peak = peak_bandwidth(device)
        rows = {}
        for b in batches:
            runs = [drive(shim, random_prompts(b, prompt_len, vocab, b), new)
                    for _ in range(sizes.repeats)]
            tpot = median([median(r["steps"]) for r in runs if r["steps"]])
            read = step_bytes(raw, dtype, b, prompt_len + new // 2, total - routed, routed)
            rows[f"batch{b}"] = {"tpot_ms": round(tpot * 1e3, 3),
                                 "output_tok_s": round(b / tpot, 1),
                                 "bytes_per_step": read,
                                 "roofline_tpot_ms": round(read / peak * 1e3, 3) if peak
                                 else None}
        out["decode"] = rows
        one = rows["batch1"]
        if device.type == "cuda":        # the same batch-1 step without the graphs
            eng = shim = None            # the graphed engine's cache goes first
            free_memory(device)
            args.enforce_eager = True
            eng = EngineCore(args.to_engine_config(), model=model)
            shim = SimpleNamespace(engine=eng)
            drive(shim, random_prompts(1, prompt_len, vocab, 0), 2)
            runs = [drive(shim, random_prompts(1, prompt_len, vocab, 1), new)
                    for _ in range(sizes.repeats)]
            eager = median([median(r["steps"]) for r in runs if r["steps"]])
            out["eager_tpot_batch1_ms"] = round(eager * 1e3, 3)
            out["graphs_vs_eager"] = round(eager * 1e3 / one["tpot_ms"], 3)
        out["peak_bandwidth"] = peak
        out["hbm_utilization_batch1"] = (round(one["bytes_per_step"] / (one["tpot_ms"] / 1e3)
                                               / peak, 4) if peak else None)
        return out
    except Exception as exc:  # noqa: BLE001 - the section reports, the run goes on
        return {**out, **error_row(exc)}
    finally:
        eng = shim = model = None        # noqa: F841 - the engine and weights go now
        free_memory(device)
