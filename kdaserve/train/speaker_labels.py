"""Speaker labels of the Shakespeare texts (kdaserve/train/corpus.py clean_text): finding
them after the cast list, splitting a label that starts a line of speech, and naming them
in one spelling (``Ham.`` -> ``HAMLET``, ``1 Citizen.`` -> ``FIRST CITIZEN``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_CONNECTIVES = frozenset({"and", "of", "the", "de", "le"})
_NOT_SPEAKERS = frozenset({"ACT", "SCENE", "SONG"})
_ORDINALS = {"1": "FIRST", "2": "SECOND", "3": "THIRD", "4": "FOURTH", "5": "FIFTH"}
_LABEL_WORD = re.compile(r"[A-Z0-9][A-Za-z0-9']*\.?")
_ROMAN = re.compile(r"[IVXLC]+\.?")
_PLURAL_SUFFIXES = ("s", "es", "men")  # "Lord." is not "Lords", "Watch." not "Watchmen"
_MAX_LABEL_WORDS = 6
_MAX_INLINE_LABEL_CHARS = 40


def _label_words(text: str) -> tuple[str, ...] | None:
    """The words of ``text`` if the whole string has the shape of a speaker label."""
    words = tuple(text.split(" "))
    if not 0 < len(words) <= _MAX_LABEL_WORDS:
        return None
    if not all(w in _CONNECTIVES or _LABEL_WORD.fullmatch(w) for w in words):
        return None
    if words[0].rstrip(".").upper() in _NOT_SPEAKERS or all(_ROMAN.fullmatch(w) for w in words):
        return None
    if not any(c.isalpha() for c in words[0]) and len(words) == 1:
        return None
    if text.endswith(".") or text.upper() == text:
        return words
    return None


def _label_key(words: Sequence[str]) -> str:
    return " ".join(words).rstrip(".").upper()


def normalise_speakers(body: list[str], header: Sequence[str]) -> list[str]:
    """The body's speaker labels as ``NAME:`` lines (corpus.clean_text says which lines are
    labels and how their names are spelled out), with the cast list in `header`."""
    labels = _find_labels(body)
    names = _LabelNamer(_cast_words(header)).names({_label_key(w) for w in labels.values()})
    out: list[str] = []
    for i, line in enumerate(body):
        if i in labels:
            out.append(names[_label_key(labels[i])] + ":")
            continue
        split = _split_inline_label(line, names) if _starts_speech(body, i) else None
        out.extend(split if split else [line])
    return out


def _starts_speech(lines: Sequence[str], i: int) -> bool:
    return i > 0 and not lines[i - 1] and bool(lines[i])


def _find_labels(lines: Sequence[str]) -> dict[int, tuple[str, ...]]:
    """Own-line labels by line index."""
    labels = {}
    for i, line in enumerate(lines[:-1]):
        if _starts_speech(lines, i) and lines[i + 1]:
            words = _label_words(line)
            if words is not None:
                labels[i] = words
    return labels


def _split_inline_label(line: str, names: dict[str, str]) -> list[str] | None:
    """``["NAME:", rest]`` if ``line`` opens with a known label followed by more text."""
    for match in re.finditer(r"\.", line[:_MAX_INLINE_LABEL_CHARS]):
        head, rest = line[: match.end()], line[match.end() :].strip()
        words = _label_words(head)
        if words is not None and rest and _label_key(words) in names:
            return [names[_label_key(words)] + ":", rest]
    return None


def _cast_words(header: Iterable[str]) -> frozenset[str]:
    """Capitalised words of the cast list, lower-cased ("son to the former" is no name)."""
    return frozenset(w.lower() for line in header for w in re.findall(r"[A-Z][A-Za-z]+", line))


class _LabelNamer:
    """Maps label keys ("HAM", "1 CLOWN", "ROS AND GUIL") to speaker names."""

    def __init__(self, cast: frozenset[str]) -> None:
        self._cast = cast

    def names(self, keys: Iterable[str]) -> dict[str, str]:
        keys = sorted(set(keys))
        words = {w for key in keys for w in key.split(" ")}
        expansions = self._expansions(words)
        return {key: self._name(key, expansions) for key in keys}

    def _name(self, key: str, expansions: dict[str, str]) -> str:
        words = key.split(" ")
        if len(words) > 1 and words[0].rstrip(".") in (*_ORDINALS, "I"):
            words[0] = _ORDINALS.get(words[0].rstrip("."), "FIRST")
        return " ".join(expansions.get(w.rstrip("."), w) for w in words)

    def _expansions(self, words: Iterable[str]) -> dict[str, str]:
        """Abbreviation -> cast word for unambiguous prefixes.

        A prefix matching several cast words is resolved when all but one of them are
        already claimed by other labels (Lear's "Cor." is Cordelia because "Corn." is
        Cornwall).
        """
        stems = {w.rstrip(".") for w in words}
        candidates = {s: self._candidates(s) for s in stems}
        unique = {s: next(iter(c)) for s, c in candidates.items() if len(c) == 1}
        claimed = set(unique.values())
        for stem, found in candidates.items():
            rest = found - claimed
            if len(found) > 1 and len(rest) == 1:
                unique[stem] = next(iter(rest))
        return {s: _singular(s, c).upper() for s, c in unique.items()}

    def _candidates(self, stem: str) -> set[str]:
        prefix = stem.lower()
        if (
            len(prefix) < 2
            or not prefix.isalpha()
            or prefix in self._cast
            or prefix in _CONNECTIVES
        ):
            return set()
        plurals = {prefix + suffix for suffix in _PLURAL_SUFFIXES}
        found = {w for w in self._cast if w.startswith(prefix) and w not in plurals}
        # A plural and its singular ("servant", "servants") are one candidate.
        return {w for w in found if not (w.endswith("s") and w[:-1] in found)}


def _singular(stem: str, word: str) -> str:
    # The cast list names groups ("Messengers", "Carriers"); a label names one of them.
    plural_role = word.endswith(("ers", "ors", "ants", "ians")) and len(word) - 1 > len(stem)
    return word[:-1] if plural_role else word


# --------------------------------------------------------------------------------------------
# Splitting
