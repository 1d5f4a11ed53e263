"""`kdaserve quantize IN OUT --scheme int4|int8`: a float checkpoint written as a
compressed-tensors pack-quantized one (weight-only, group-wise scales; `weight_packed` int32,
`weight_scale`, `weight_shape`, `weight_zero_point` when asymmetric), which kdaserve, vLLM and
other compressed-tensors readers load. Layers whose width is not a multiple of the group stay
float (listed in the config's `ignore`: compressed-tensors has no shorter last group). The
tokenizer, other side files and subfolders (a DSpark draft) are copied as they are."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

log = logging.getLogger("kdaserve")

# files of a checkpoint directory the new one writes itself
_WRITTEN = ("config.json", "model.safetensors.index.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="float checkpoint directory (config.json + safetensors)")
    p.add_argument("output", help="directory to write (created)")
    p.add_argument("--scheme", required=True, choices=("int8", "int4"))
    p.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale (default: 128)")
    p.add_argument("--asymmetric", action="store_true",
                   help="a zero point per group too (default: symmetric)")
    p.add_argument("--ignore", action="append", default=[], metavar="NAME",
                   help="a module to leave unquantized: its name (lm_head) or re:PATTERN; "
                        "may repeat")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="dtype of the tensors left unquantized (default: the input's "
                        "config.json dtype, else float32)")


def run(args: argparse.Namespace) -> int:
    from kdaserve.model.checkpoint_files import CheckpointError
    from kdaserve.model.loader import load_model, parse_dtype, save_model
    from kdaserve.model.registry import read_config_json
    from kdaserve.quant_config import SCHEMES, WeightQuant

    src, out = Path(args.input), Path(args.output)
    if out.resolve() == src.resolve():
        raise SystemExit("kdaserve quantize: OUT must differ from IN")
    raw = read_config_json(src)
    dtype = args.dtype or raw.get("dtype") or raw.get("torch_dtype") or "float32"
    wq = WeightQuant(SCHEMES[args.scheme], args.group_size, not args.asymmetric,
                     ignore=tuple(args.ignore))
    # quantized as it loads: a bf16 checkpoint's floats are never all in fp32 at once
    try:
        model = load_model(src, dtype="float32", progress=False, quantization=wq,
                           whole_groups=True)
    except CheckpointError as e:            # e.g. IN is quantized already
        raise SystemExit(f"kdaserve quantize: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out, dtype=parse_dtype(dtype))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _WRITTEN:
            shutil.copy2(f, out / f.name)
        elif f.is_dir():              # a draft model beside it (draft/), kept as it is
            shutil.copytree(f, out / f.name, dirs_exist_ok=True)
    left = len(model.config.weight_quant.ignore) - len(wq.ignore)
    if left:
        log.warning("kdaserve quantize: %d layers (or MoE layers' experts) have widths that "
                    "are not a multiple of %d and stay float (listed in ignore); a group "
                    "size dividing every width quantizes them too", left, wq.group_size)
    rep = model.weight_report()
    log.info("kdaserve quantize: %s -> %s (%s, group %d): %.1f MiB", src, out, wq.scheme,
             wq.group_size, rep["bytes"] / 2**20)
    return 0
