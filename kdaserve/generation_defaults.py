"""Sampling defaults from a model's generation_config.json (like vLLM's --generation-config
auto)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kdaserve.request import SamplingParams

_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    out = {k: raw[k] for k in _KEYS if raw.get(k) is not None}
    if raw.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def sampling_params_with_defaults(model_dir: str | Path, fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams from request fields; None means 'not given' and takes the model default."""
    merged = dict(generation_defaults(model_dir))
    merged.update({k: v for k, v in fields.items() if v is not None})
    return SamplingParams(**merged)
