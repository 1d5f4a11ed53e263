"""The bundled models: the text demo model, and the small vision demo (the synthetic shapes
task of kdaserve/train/shapes.py); each a directory with config.json, model.safetensors and
tokenizer files."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo"
VISION_DEMO_DIR = Path(__file__).parent / "vision-demo"


def default_model_path() -> Path:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled demo model is missing at {DEMO_MODEL_DIR}; pass --model PATH"
        )
    return DEMO_MODEL_DIR


def default_vision_model_path() -> Path:
    """The vision demo: `kdaserve serve --model <this>` names the colour and shape in an image."""
    if not (VISION_DEMO_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the bundled vision demo model is missing at {VISION_DEMO_DIR}")
    return VISION_DEMO_DIR
