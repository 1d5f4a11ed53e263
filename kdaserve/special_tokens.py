"""Special tokens as a checkpoint declares them: the named tokens and added tokens of
tokenizer_config.json, and the end-of-sequence ids of generation_config.json / config.json."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["EOS_CONFIG_FILES", "TOKENIZER_CONFIG_FILE", "added_tokens", "extra_eos_ids",
           "read_json", "token_content"]

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
EOS_CONFIG_FILES = ("generation_config.json", "config.json")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when the file is absent (every config file is optional)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON in {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must contain a JSON object")
    return data


def token_content(value: Any) -> str | None:
    """A token given as a string or as an AddedToken dict (``{"content": ...}``)."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def added_tokens(config: Mapping[str, Any]) -> dict[str, int]:
    """``added_tokens_decoder`` as token -> id: a tiktoken file holds no special tokens."""
    decoder = config.get("added_tokens_decoder") or {}
    tokens = {}
    for token_id, entry in decoder.items():
        content = token_content(entry)
        if content is None:
            raise ValueError(f"added_tokens_decoder[{token_id!r}] has no string 'content'")
        tokens[content] = int(token_id)
    return tokens


def extra_eos_ids(directory: Path) -> list[int]:
    """Every ``eos_token_id`` the generation and model configs name, first seen first."""
    ids: list[int] = []
    for name in EOS_CONFIG_FILES:
        value = read_json(directory / name).get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"eos_token_id in {directory / name} must be an int or list of ints")
        ids += [v for v in values if v not in ids]
    return ids
