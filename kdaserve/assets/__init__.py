"""The bundled models, each a directory with config.json, model.safetensors, tokenizer files and
a DSpark draft in `draft/`:
- `demo/`: what `kdaserve serve` serves by default, a tiny Kimi K3 (attention residuals, SiTU,
  latent MoE, gated KDA/MLA) with its MoonViT tower, trained on Shakespeare and on the synthetic
  shapes task (kdaserve/train/k3_demo.py; docs/demo-model.md);
- `kimi-linear-demo/`: the text-only Kimi Linear demo, the checkpoint llama.cpp's converter and
  transformers' KimiLinear take (bench compare, the transformers reference tests)."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo"
KIMI_LINEAR_DEMO_DIR = Path(__file__).parent / "kimi-linear-demo"


def _bundled(path: Path, what: str) -> Path:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the bundled {what} is missing at {path}; pass --model PATH")
    return path


def default_model_path() -> Path:
    """The demo `kdaserve serve` serves: a tiny Kimi K3 that reads images too."""
    return _bundled(DEMO_MODEL_DIR, "demo model")


def kimi_linear_demo_path() -> Path:
    """The Kimi Linear demo (text only): the checkpoint both engines of bench compare run."""
    return _bundled(KIMI_LINEAR_DEMO_DIR, "Kimi Linear demo model")
