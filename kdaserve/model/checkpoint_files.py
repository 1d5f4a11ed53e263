"""Which files hold a checkpoint's weights (safetensors only, never pickles). Its own module
because the draft model loads its checkpoint too, and the loader imports the registry, which
imports the draft model."""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, unexpected, or of the wrong shape."""


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
