"""Who may read a persistent tier's entries: the model identity and the cache layout.

An entry is only valid for the weights and the cache layout that produced it. The identity
hashes (xxh3-128):
  - config.json, byte for byte;
  - per weight file: its name, size, safetensors header (tensor names, dtypes, shapes, offsets)
    and three 64 KiB samples of its content (start, middle, end). The brief asked for metadata;
    the samples are there because a fine-tune has exactly the same metadata as its base model,
    and mixing their caches would produce wrong tokens. Reading 192 KiB per file is cheap;
  - the layout: block size, cache dtype, latent and state dims, layer lists, the KDA chunk
    size and the device type (a snapshot taken by another kernel may differ in its last bits,
    and the engine promises token-identical output with and without offload).
No torch: plain file reads.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import xxhash

FORMAT_VERSION = 1
_SAMPLE = 64 << 10
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weights_fingerprint(model_dir: Path) -> dict[str, Any]:
    """Name -> (size, header hash, content sample hash) for each weight file of `model_dir`."""
    out: dict[str, Any] = {}
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or not path.name.endswith(_WEIGHT_SUFFIXES):
            continue
        size = path.stat().st_size
        head = xxhash.xxh3_128()
        sample = xxhash.xxh3_128()
        with open(path, "rb") as f:
            if path.suffix == ".safetensors" and size >= 8:
                (n,) = struct.unpack("<Q", f.read(8))
                head.update(f.read(min(n, size - 8)))
            for at in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                f.seek(at)
                sample.update(f.read(_SAMPLE))
        out[path.name] = [size, head.hexdigest(), sample.hexdigest()]
    return out


def cache_layout(cfg: Any, block_size: int, dtype: str, chunk_size: int,
                 device_type: str) -> dict[str, Any]:
    """The cache layout of a ModelConfig `cfg` (duck-typed: cache/ imports no model code)."""
    return {"format": FORMAT_VERSION, "block_size": block_size, "dtype": dtype,
            "mla_layers": list(cfg.mla_layers), "mla_latent_dim": cfg.mla_latent_dim,
            "kda_layers": list(cfg.kda_layers), "kda_num_heads": cfg.kda_num_heads,
            "kda_head_dim": cfg.kda_head_dim, "conv_kernel_size": cfg.conv_kernel_size,
            "kda_conv_dim": cfg.kda_conv_dim, "kda_chunk_size": chunk_size,
            "device_type": device_type}


def offload_identity(model_dir: str | Path, layout: dict[str, Any]) -> tuple[bytes, dict]:
    """(16-byte identity, a description written next to the entries for people)."""
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    if not config.is_file():
        raise ValueError(f"the disk offload tier needs a model directory with config.json "
                         f"(its identity keys the entries); {model_dir} has none")
    described = {"model_dir": str(model_dir.resolve()),
                 "config_xxh3_128": xxhash.xxh3_128_hexdigest(config.read_bytes()),
                 "weights": weights_fingerprint(model_dir), "layout": layout}
    blob = json.dumps({k: v for k, v in described.items() if k != "model_dir"},
                      sort_keys=True).encode()
    return xxhash.xxh3_128_digest(blob), described
