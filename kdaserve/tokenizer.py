"""Tokenizer facade over HF ``tokenizer.json`` and Kimi-style ``tiktoken.model`` files.

Special tokens are always recognised in input text, and ``decode(skip_special_tokens=True)``
removes exactly the ids in ``Tokenizer.special_token_ids`` for both backends.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers

from kdaserve.chat_template import ChatTemplateRenderer, load_chat_template
from kdaserve.special_tokens import (
    TOKENIZER_CONFIG_FILE,
    added_tokens,
    extra_eos_ids,
    read_json,
    token_content,
)
from kdaserve.tiktoken_backend import TiktokenBackend
from kdaserve.user_text import segments

__all__ = ["HFBackend", "Tokenizer", "TokenizerBackend"]

HF_TOKENIZER_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tiktoken.model"


class TokenizerBackend(Protocol):
    """What Tokenizer needs of a vocabulary; ``raw`` and ``max_token_bytes`` are optional."""

    vocab_size: int

    def encode(self, text: str, specials: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def special_ids(self) -> dict[int, str]: ...


class HFBackend:
    """An HF ``tokenizer.json``."""

    def __init__(self, path: Path) -> None:
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        self._literal: tokenizers.Tokenizer | None = None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def raw(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str, specials: bool = True) -> list[int]:
        tok = self._tok
        if not specials:            # special tokens' text encoded as its characters
            tok = self._literal
            if tok is None:
                tok = self._literal = tokenizers.Tokenizer.from_str(self._tok.to_str())
                tok.encode_special_tokens = True
        # encode_batch releases the GIL (encode does not), so a long text tokenized in a worker
        # thread leaves the server's event loop running
        if len(text) > 4096:
            return tok.encode_batch([text], add_special_tokens=False)[0].ids
        return tok.encode(text, add_special_tokens=False).ids

    def max_token_bytes(self) -> int:
        return max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)),
                   default=1)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id) if token_id >= 0 else None

    def special_ids(self) -> dict[int, str]:
        added = self._tok.get_added_tokens_decoder()
        return {i: tok.content for i, tok in added.items() if tok.special}


class Tokenizer:
    """Encode/decode text, expose special ids, and render chat templates."""

    def __init__(
        self,
        backend: TokenizerBackend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.vocab_size: int = backend.vocab_size
        self.bos_token_id = self._lookup(bos_token)
        self.pad_token_id = self._lookup(pad_token)
        eos_id = self._lookup(eos_token)
        self.eos_token_id = eos_id if eos_id is not None else next(iter(extra_eos_ids), None)
        self.eos_token_ids = frozenset([*extra_eos_ids, *([eos_id] if eos_id is not None else [])])
        named = (self.bos_token_id, self.eos_token_id, self.pad_token_id)
        self.special_token_ids = frozenset(backend.special_ids()) | {
            i for i in named if i is not None
        }
        self._chat_renderer = ChatTemplateRenderer()
        self._special_words = frozenset(backend.decode([i]) for i in self.special_token_ids)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        directory = Path(path)
        hf_file, tiktoken_file = directory / HF_TOKENIZER_FILE, directory / TIKTOKEN_FILE
        config = read_json(directory / TOKENIZER_CONFIG_FILE)
        backend: TokenizerBackend
        if hf_file.is_file():
            backend = HFBackend(hf_file)
        elif tiktoken_file.is_file():
            backend = TiktokenBackend(tiktoken_file, added_tokens(config))
        else:
            what = "directory does not exist" if not directory.is_dir() else "no tokenizer file"
            raise FileNotFoundError(
                f"cannot load tokenizer from {str(directory)!r} ({what}): "
                f"expected {HF_TOKENIZER_FILE} or {TIKTOKEN_FILE} in it"
            )
        return cls(
            backend,
            bos_token=token_content(config.get("bos_token")),
            eos_token=token_content(config.get("eos_token")),
            pad_token=token_content(config.get("pad_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=load_chat_template(directory, config),
            extra_eos_ids=extra_eos_ids(directory),
        )

    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def max_token_bytes(self) -> int:
        """Bytes of the longest token: a text longer than N times this has more than N
        tokens."""
        fn = getattr(self._backend, "max_token_bytes", None)
        return int(fn()) if fn is not None else 64

    def encode(self, text: str, add_special_tokens: bool = False, specials: bool = True,
               marked: bool = False) -> list[int]:
        """specials=False: special tokens' text is encoded as text, never as control ids (user
        text). marked: a rendered chat whose user strings went through
        kdaserve/user_text.py's SpecialTextGuard.mark: the marked spans are text."""
        if marked:
            ids = [t for piece, literal in segments(text, self._special_words)
                   for t in self._backend.encode(piece, specials=specials and not literal)]
        else:
            ids = self._backend.encode(text, specials=specials)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode ids; ids outside the vocabulary are dropped silently."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_token_ids]
        return self._backend.decode(list(ids))

    def token_to_id(self, s: str) -> int | None:
        return self._backend.token_to_id(s)

    def raw_backend(self) -> Any:
        """The `tokenizers.Tokenizer` or `tiktoken.Encoding` underneath (for grammar engines
        that read the vocabulary themselves)."""
        return getattr(self._backend, "raw", None)

    def id_to_token(self, i: int) -> str | None:
        """Token string; tiktoken tokens use the GPT-2 byte-level alphabet (space -> "Ġ")."""
        return self._backend.id_to_token(i)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the chat template; message or template errors raise ValueError."""
        return self._chat_renderer.render(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
