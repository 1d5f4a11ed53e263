"""Tokenizer facade over HF ``tokenizer.json`` and Kimi-style ``tiktoken.model`` files.

Special tokens are always recognised in input text, and ``decode(skip_special_tokens=True)``
removes exactly the ids in ``Tokenizer.special_token_ids`` for both backends.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.sandbox
import tiktoken
import tiktoken.load
import tokenizers

__all__ = ["DEFAULT_CHAT_TEMPLATE", "KIMI_PAT_STR", "KIMI_PAT_STR_FALLBACK", "Tokenizer"]

HF_TOKENIZER_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
EOS_CONFIG_FILES = ("generation_config.json", "config.json")

_LETTERS_NO_HAN = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWER_NO_HAN = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"


def _kimi_pat_str(letters: str, lower: str) -> str:
    return "|".join(
        [
            r"[\p{Han}]+",
            rf"[^\r\n\p{{L}}\p{{N}}]?{letters}*{lower}+{_CONTRACTIONS}",
            rf"[^\r\n\p{{L}}\p{{N}}]?{letters}+{lower}*{_CONTRACTIONS}",
            r"\p{N}{1,3}",
            r" ?[^\s\p{L}\p{N}]+[\r\n]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        ]
    )


KIMI_PAT_STR = _kimi_pat_str(_LETTERS_NO_HAN, _LOWER_NO_HAN)
# Same language as KIMI_PAT_STR, with each `[X&&[^\p{Han}]]` class intersection rewritten as
# `(?:(?!\p{Han})[X])`; used only if tiktoken's regex engine rejects the intersections.
KIMI_PAT_STR_FALLBACK = _kimi_pat_str(
    r"(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])",
    r"(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])",
)

# tiktoken's backtracking regex overflows its stack on very long runs of whitespace or
# non-whitespace (observed at ~1M spaces), so such runs are encoded in slices of this size.
_MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"\s{{{_MAX_RUN_CHARS},}}|\S{{{_MAX_RUN_CHARS},}}")

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
"""Used when the checkpoint has no chat template: ``<|role|>\\ncontent\\n`` per message, then
``<|assistant|>\\n`` if a generation prompt is requested. The markers are plain text."""


class _Backend(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def special_ids(self) -> dict[int, str]: ...


class _HFBackend:
    def __init__(self, path: Path) -> None:
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def raw(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a long text tokenized in a worker
        # thread leaves the server's event loop running
        if len(text) > 4096:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

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


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2 byte-to-printable-character table, so tiktoken tokens print like HF ByteLevel."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    unprintable = [b for b in range(256) if b not in table]
    table.update({b: chr(0x100 + n) for n, b in enumerate(unprintable)})
    return table


_BYTE_TO_CHAR = _byte_level_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _load_ranks(path: Path) -> dict[bytes, int]:
    # load_tiktoken_bpe caches files under a key derived from the path only; passing the
    # content hash makes it discard a stale cached copy when the file has changed.
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return tiktoken.load.load_tiktoken_bpe(str(path), expected_hash=digest)


def _build_encoding(
    name: str,
    ranks: dict[bytes, int],
    specials: dict[str, int],
    pat_strs: Sequence[str] = (KIMI_PAT_STR, KIMI_PAT_STR_FALLBACK),
) -> tiktoken.Encoding:
    """Build with the first pattern tiktoken's regex engine accepts."""
    errors = []
    for pat_str in pat_strs:
        try:
            return tiktoken.Encoding(
                name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials
            )
        except ValueError as exc:
            errors.append(str(exc))
    raise ValueError(f"tiktoken rejected every split pattern: {errors}")


def _split_long_runs(text: str) -> Iterator[str]:
    pos = 0
    for match in _LONG_RUN.finditer(text):
        if match.start() > pos:
            yield text[pos : match.start()]
        for start in range(match.start(), match.end(), _MAX_RUN_CHARS):
            yield text[start : min(start + _MAX_RUN_CHARS, match.end())]
        pos = match.end()
    if pos < len(text):
        yield text[pos:]


class _TiktokenBackend:
    def __init__(self, path: Path, specials: dict[str, int]) -> None:
        ranks = _load_ranks(path)
        clashes = sorted(set(ranks.values()) & set(specials.values()))
        if clashes:
            raise ValueError(f"special token ids {clashes[:5]} collide with ranks in {path}")
        self._enc = _build_encoding(path.name, ranks, specials)
        self._bytes_by_id = {rank: token for token, rank in ranks.items()}
        self._ranks = ranks
        self._specials = dict(specials)
        self._special_by_id = {i: s for s, i in specials.items()}
        self._special_re = (
            re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
            if specials
            else None
        )
        self.vocab_size = self._enc.n_vocab

    @property
    def raw(self) -> tiktoken.Encoding:
        return self._enc

    def encode(self, text: str) -> list[int]:
        if self._special_re is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        pos = 0
        for match in self._special_re.finditer(text):
            ids += self._encode_ordinary(text[pos : match.start()])
            ids.append(self._specials[match.group()])
            pos = match.end()
        ids += self._encode_ordinary(text[pos:])
        return ids

    def max_token_bytes(self) -> int:
        return max([len(t) for t in self._ranks] + [len(s.encode()) for s in self._specials])

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _split_long_runs(text):
            ids += self._enc.encode_ordinary(piece)
        return ids

    def decode(self, ids: list[int]) -> str:
        known = [i for i in ids if i in self._bytes_by_id or i in self._special_by_id]
        return self._enc.decode(known)

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        if all(c in _CHAR_TO_BYTE for c in token):
            rank = self._ranks.get(bytes(_CHAR_TO_BYTE[c] for c in token))
            if rank is not None:
                return rank
        return self._ranks.get(token.encode("utf-8"))

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._special_by_id:
            return self._special_by_id[token_id]
        token = self._bytes_by_id.get(token_id)
        return None if token is None else "".join(_BYTE_TO_CHAR[b] for b in token)

    def special_ids(self) -> dict[int, str]:
        return dict(self._special_by_id)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON in {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must contain a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _added_tokens(config: Mapping[str, Any]) -> dict[str, int]:
    decoder = config.get("added_tokens_decoder") or {}
    tokens = {}
    for token_id, entry in decoder.items():
        content = _token_content(entry)
        if content is None:
            raise ValueError(f"added_tokens_decoder[{token_id!r}] has no string 'content'")
        tokens[content] = int(token_id)
    return tokens


def _extra_eos_ids(directory: Path) -> list[int]:
    ids: list[int] = []
    for name in EOS_CONFIG_FILES:
        value = _read_json(directory / name).get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"eos_token_id in {directory / name} must be an int or list of ints")
        ids += [v for v in values if v not in ids]
    return ids


def _load_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # HF's named-template form: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    path = directory / CHAT_TEMPLATE_FILE
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **kw: Any) -> str:
    # Jinja's builtin tojson HTML-escapes <, >, & and ', which chat templates must not do.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, **kw)


def _make_jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"messages[{index}]['content'] must be a string or a list of text parts, "
            f"got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise ValueError(f"messages[{index}]['content'][{j}] must be a {{'type': 'text'}} part")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{index}]['content'][{j}]['text'] must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Copy messages with content flattened to a string (text parts joined by newlines).

    A message carrying ``tool_calls`` may omit its content (None becomes "").
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
        content = message.get("content")
        if content is None and message.get("tool_calls"):
            content = ""
        elif "content" not in message:
            raise ValueError(f"messages[{i}] needs a 'content'")
        normalized.append({**message, "content": _content_text(i, content)})
    return normalized


class Tokenizer:
    """Encode/decode text, expose special ids, and render chat templates."""

    def __init__(
        self,
        backend: _Backend,
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
        self._jinja_env = _make_jinja_env()
        self._templates: dict[str, jinja2.Template] = {}

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        directory = Path(path)
        hf_file, tiktoken_file = directory / HF_TOKENIZER_FILE, directory / TIKTOKEN_FILE
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        backend: _Backend
        if hf_file.is_file():
            backend = _HFBackend(hf_file)
        elif tiktoken_file.is_file():
            backend = _TiktokenBackend(tiktoken_file, _added_tokens(config))
        else:
            what = "directory does not exist" if not directory.is_dir() else "no tokenizer file"
            raise FileNotFoundError(
                f"cannot load tokenizer from {str(directory)!r} ({what}): "
                f"expected {HF_TOKENIZER_FILE} or {TIKTOKEN_FILE} in it"
            )
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=_load_chat_template(directory, config),
            extra_eos_ids=_extra_eos_ids(directory),
        )

    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def max_token_bytes(self) -> int:
        """Bytes of the longest token: a text longer than N times this has more than N
        tokens."""
        fn = getattr(self._backend, "max_token_bytes", None)
        return int(fn()) if fn is not None else 64

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._backend.encode(text)
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
        normalized = _normalize_messages(messages)
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **kwargs,
            "messages": normalized,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template().render(**context)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc

    def _template(self) -> jinja2.Template:
        source = self.chat_template if self.chat_template is not None else DEFAULT_CHAT_TEMPLATE
        if source not in self._templates:
            self._templates[source] = self._jinja_env.from_string(source)
        return self._templates[source]
