"""The bundled demo model (config.json, model.safetensors, tokenizer files)."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo"


def default_model_path() -> Path:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled demo model is missing at {DEMO_MODEL_DIR}; pass --model PATH"
        )
    return DEMO_MODEL_DIR
