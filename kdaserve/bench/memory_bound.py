"""`kdaserve bench compare --shape memory-bound`: the regime every real checkpoint runs in.

The bundled demo (13M parameters) mostly sits in a CPU's last-level cache, so its decode
speed says little about what a user meets. This builds, once, a random model of the demo's
family (Kimi Linear: the demo's layer pattern, tokenizer and MLA dimensions) whose active
weights per token, as bf16, are at least 8x this machine's last-level cache: every decode
step then reads them from memory. It is saved as an HF checkpoint under the peers directory
with its GGUFs for llama.cpp (bf16 and Q8_0 by llama.cpp's converter, Q4_0 by its
quantizer, all from the same weights), and a STREAM-like read rate is measured in the same
run, so each figure can be put as a fraction of what the memory delivers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kdaserve.assets import kimi_linear_demo_path
from kdaserve.bench.llamacpp import gguf_kind, setup_peers
from kdaserve.ops.cpu_isa import llc_bytes

# the scales tried, smallest first: (hidden size (heads of 64), experts of hidden / 2; top 8).
# The last halves the experts: h4096's active bytes at h3072's total (7.5 GB as bf16). A 480
# MiB L3 (seen on a 24 GiB VM) calls for 4 GB a token, and the bench holds llama.cpp's copy
# beside kdaserve's: two of h4096 with 32 experts (13.2 GB each) would not fit.
_SCALES = ((512, 32), (768, 32), (1024, 32), (1536, 32), (2048, 32), (3072, 32), (4096, 16))
LLC_MULTIPLE = 8
FP32_BUILD_LIMIT = 2 << 30     # active bf16 bytes; past it the random model is built in bf16


def config_for(hidden: int, experts: int = 32) -> dict:
    """The demo's config at another scale: 8 layers (6 KDA, 2 MLA), `experts` experts, top 8."""
    raw = json.loads((kimi_linear_demo_path() / "config.json").read_text())
    heads = hidden // 64
    raw.update(hidden_size=hidden, intermediate_size=2 * hidden,
               moe_intermediate_size=hidden // 2, num_experts=experts, num_experts_per_token=8,
               num_attention_heads=heads, num_key_value_heads=heads)
    raw["linear_attn_config"] = {**raw["linear_attn_config"], "num_heads": heads}
    return raw


def _bf16_size(raw: dict):
    """kdaserve inspect's parameter count of the config `raw`, as bf16."""
    from kdaserve.model.inspect import measure
    from kdaserve.model.registry import load_config

    return measure(load_config(raw), "bfloat16")


def active_bf16_bytes(raw: dict) -> int:
    """Bytes of the weights a decode token reads, as bf16 (kdaserve inspect's count, less
    the embedding, of which a token reads one row)."""
    size = _bf16_size(raw)
    return int(2 * (size.total_active - size.active.get("embedding", 0)))


def total_bf16_bytes(raw: dict) -> int:
    """Bytes of all the weights, as bf16 (what a copy of the checkpoint holds)."""
    return int(2 * _bf16_size(raw).total)


def ram_bytes() -> int:
    """This machine's physical memory (0 when it cannot tell: no limit applied)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def pick_shape(llc: int, ram: int = 0) -> dict:
    """The smallest scale whose active bf16 bytes a token are LLC_MULTIPLE x `llc`, among
    those whose two bf16 copies (kdaserve's and llama.cpp's, held at once) fit 90% of `ram`;
    if none reaches the multiple, the largest that fits (the JSON prints `llc_multiple`)."""
    fits = [config_for(h, e) for h, e in _SCALES]
    if ram:
        fits = [raw for raw in fits if 2 * total_bf16_bytes(raw) <= 0.9 * ram] or fits[:1]
    for raw in fits:
        if active_bf16_bytes(raw) >= LLC_MULTIPLE * llc:
            return raw
    return fits[-1]


def model_name(raw: dict) -> str:
    """memory-bound-h<hidden>, with -e<experts> where they are not 32 (names kept from before)."""
    experts = "" if raw["num_experts"] == 32 else f"-e{raw['num_experts']}"
    return f"memory-bound-h{raw['hidden_size']}{experts}"


def ensure_model(peers: Path, seed: int = 0) -> Path:
    """The checkpoint for this machine's cache (built once, bf16), under peers/models."""
    from kdaserve.model.random_init import init_random
    from kdaserve.model.registry import build_model, load_config
    from kdaserve.model.saver import save_model

    raw = pick_shape(llc_bytes(), ram_bytes())
    out = peers / "models" / model_name(raw)
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    # A shape past FP32_BUILD_LIMIT is built in bf16: its fp32 copy beside the saved bf16 one
    # would not fit the RAM of the machines whose cache calls for it (h3072 on a 480 MiB L3).
    dtype = torch.float32 if active_bf16_bytes(raw) <= FP32_BUILD_LIMIT else torch.bfloat16
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = init_random(build_model(load_config(raw)), seed)
    finally:
        torch.set_default_dtype(saved)
    save_model(model, tmp, dtype=torch.bfloat16)
    del model
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(kimi_linear_demo_path() / f, tmp / f)
    tmp.rename(out)
    return out


def ensure_gguf(peers: Path, model: Path, quantization: str | None) -> Path:
    """llama.cpp's copy of the same weights: bf16 and Q8_0 converted from the checkpoint,
    Q4_0 quantized from the bf16 GGUF by llama.cpp's own quantizer."""
    kind = gguf_kind(quantization, "bfloat16")
    out = peers / "models" / f"{model.name}-{kind}.gguf"
    if out.is_file():
        return out
    python = peers / "llamacpp-venv" / "bin" / "python"
    if kind == "q4_0":
        src = ensure_gguf(peers, model, None)
        code = ("import ctypes, sys, llama_cpp as l; "
                "p = l.llama_model_quantize_default_params(); "
                "p.ftype = l.LLAMA_FTYPE_MOSTLY_Q4_0; p.nthread = 2; "
                "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
                "ctypes.byref(p)))")
        subprocess.run([str(python), "-c", code, str(src), str(out)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return out
    src = peers / "sdist" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    here = Path(__file__).parent / "peers"
    subprocess.run([sys.executable, str(here / "convert_gguf.py"), str(src), str(model),
                    "--outtype", kind, "--outfile", str(out)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def read_rate(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Bytes a second this machine reads from memory: the best of `repeats` sums over a
    buffer far past the cache (STREAM's idea, with torch's reduction on `threads`)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(mib << 18, dtype=torch.float32)      # mib MiB
        buf.sum()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t)
        return buf.numel() * 4 / best
    finally:
        torch.set_num_threads(saved)


def beside_read_rate(run: Callable[..., dict], threads: int) -> Callable[..., dict]:
    """`run` with the read rate measured just before and just after it: its result gains
    read_bytes_per_s, the larger of the two (best of three sums each). The host's rate moved
    between 31 and 60 GB/s from one run to the next on the Zen 4 machine (docs/benchmarks.md),
    so a decode is measured against the rate of its own moment, not one taken seconds away."""
    def timed(*args, **kwargs) -> dict:
        before = read_rate(threads, repeats=3)
        res = run(*args, **kwargs)
        return {**res, "read_bytes_per_s": max(before, read_rate(threads, repeats=3))}
    return timed


def active_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode token reads in the model as loaded (packed layers at
    their packed size with their scales; routed experts at top-k of E; one embedding row)."""
    from kdaserve.model.inspect import measure_model

    cfg = model.config
    size = measure_model(model, cfg)
    share = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 0.0
    total = 0.0
    for part, b in size.stored_bytes.items():
        if part == "embedding":
            continue
        total += b * (share if part in ("routed experts", "expert scales") else 1.0)
    return int(total)


def setup(args, peers: Path, extra: dict) -> tuple[str, str]:
    """The memory-bound run's model and GGUF kind; sets its dtype (bf16, or fp32 around
    the packed layers of --quantization) and fills `extra` with the shape's figures."""
    model = ensure_model(peers)
    if args.setup_peers:         # llama.cpp itself and its bf16 GGUF of the model
        setup_peers(peers, str(model), "bfloat16")
    if (peers / "llamacpp-venv" / "bin" / "python").is_file():
        ensure_gguf(peers, model, args.quantization)
    args.dtype = "float32" if args.quantization else "bfloat16"
    raw = json.loads((model / "config.json").read_text())
    llc, active = llc_bytes(), active_bf16_bytes(raw)
    extra.update(shape="memory-bound", model=str(model), hidden_size=raw["hidden_size"],
                 num_experts=raw["num_experts"], quantization=args.quantization, llc_bytes=llc,
                 active_bf16_bytes_per_token=active, llc_multiple=round(active / llc, 2))
    return str(model), gguf_kind(args.quantization, "bfloat16")


def decode_report(model: torch.nn.Module, single: dict[str, list[dict]], out: int,
                  threads: int) -> dict:
    """Decode alone, and kdaserve's as a fraction of the machine's read rate: the one measured
    beside its best decode (beside_read_rate), or now where the runs carry none. Each side
    times its own single-stream runs' prefill (to the first token) and decode (the out - 1
    steps after it), best of the runs: the single stream's time less a prefill timed in other
    runs moved with the machine (one run read 351 and the next 222 tok/s)."""
    active = active_bytes(model)
    res: dict = {"active_weight_bytes_per_token": active}
    rate = 0.0
    for side, runs in single.items():
        if not runs:
            continue
        res[f"{side}_single_prefill_seconds"] = round(min(r["prefill_seconds"] for r in runs), 4)
        best = min(runs, key=lambda r: r["decode_seconds"])
        res[f"{side}_decode_tok_s"] = round((out - 1) / max(best["decode_seconds"], 1e-9), 2)
        if side == "kdaserve":
            # the rate beside the best decode (beside_read_rate), else one measured now
            rate = best.get("read_bytes_per_s", 0.0)
            seen = [r["read_bytes_per_s"] for r in runs if "read_bytes_per_s" in r]
            if seen:
                res["read_bytes_per_s_range"] = [round(min(seen)), round(max(seen))]
    rate = rate or read_rate(threads)       # runs without their own: one measured now
    res["read_bytes_per_s"] = round(rate)
    res["bandwidth_fraction_single"] = round(active * res["kdaserve_decode_tok_s"] / rate, 3)
    if "llamacpp_decode_tok_s" in res:
        res["ratio_vs_llamacpp_decode"] = round(
            res["kdaserve_decode_tok_s"] / res["llamacpp_decode_tok_s"], 3)
    return res
