"""Structured outputs: specs (plain data, `spec.py`), llguidance grammars (`compiler.py`),
per-request matchers (`matcher.py`), token bitmasks (`bitmask.py`) and the engine-side manager
(`manager.py`). Only `spec` is imported by code outside the engine process."""
