"""The tiktoken backend: Kimi-style ``tiktoken.model`` BPE ranks, Kimi's split pattern, and
token strings in the GPT-2 byte-level alphabet so they print like the HF backend's."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import tiktoken
import tiktoken.load

__all__ = ["KIMI_PAT_STR", "KIMI_PAT_STR_FALLBACK", "TiktokenBackend"]

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


class TiktokenBackend:
    """A Kimi-style ``tiktoken.model`` file with its special tokens from tokenizer_config.json."""

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

    def encode(self, text: str, specials: bool = True) -> list[int]:
        if self._special_re is None or not specials:
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
