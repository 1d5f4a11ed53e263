"""kdaserve: an inference and serving engine for hybrid KDA + MLA MoE models (Kimi Linear family)."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import kdaserve.config` does not pull torch and the engine.
    if name == "LLM":
        from kdaserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kdaserve.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
