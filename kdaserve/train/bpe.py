"""Byte-level BPE tokenizer for the demo model, saved in the Hugging Face layout."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_MODEL_MAX_LENGTH",
    "DEFAULT_SPECIALS",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "save_tokenizer",
    "train_bpe_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DEFAULT_SPECIALS: tuple[str, ...] = (EOS_TOKEN, "<|im_start|>", "<|im_end|>", PAD_TOKEN)
DEFAULT_MODEL_MAX_LENGTH = 4096
_BYTE_ALPHABET_SIZE = 256

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
``<|im_start|>assistant\\n`` for a generation prompt. Written without block-tag newlines so
that it renders the same with or without Jinja's ``trim_blocks``/``lstrip_blocks``."""


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 4096,
    special_tokens: Sequence[str] = DEFAULT_SPECIALS,
) -> tokenizers.Tokenizer:
    """Train a byte-level BPE; ``special_tokens`` take ids ``0..len-1`` in order.

    Every byte is in the initial alphabet, so any text encodes without unknown tokens and
    decodes back exactly.
    """
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"special tokens must be distinct: {list(special_tokens)}")
    minimum = _BYTE_ALPHABET_SIZE + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (bytes + specials)")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(
    tok: tokenizers.Tokenizer,
    out_dir: Path,
    *,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    for token in (EOS_TOKEN, PAD_TOKEN):
        if tok.token_to_id(token) is None:
            raise ValueError(f"tokenizer has no {token!r} token")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = _tokenizer_config(tok, model_max_length)
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")


def _tokenizer_config(tok: tokenizers.Tokenizer, model_max_length: int) -> dict[str, Any]:
    added = sorted(tok.get_added_tokens_decoder().items())
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # Decoding must reproduce the text byte for byte, e.g. keep " ," and " 's".
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token.content,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for token_id, token in added
        },
    }
