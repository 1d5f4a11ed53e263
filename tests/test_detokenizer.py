from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kdaserve.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from kdaserve.tiktoken_backend import _BYTE_TO_CHAR
from kdaserve.tokenizer import Tokenizer

CORPUS = [
    "你好世界 🙂🙂 héllo wörld",
    "日本語のテキスト 😀🎉 ñandú",
    "hello STOP world",
    "中文 🙂 ok",
]
FFFD = "\ufffd"


def build_hf(path: Path) -> Tokenizer:
    """Byte-level BPE with few merges, so most multi-byte characters span several tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return Tokenizer.from_pretrained(path)


def build_tiktoken(path: Path) -> Tokenizer:
    merges = ["你".encode()[:2], "🙂".encode()[:3], b"he", b"hel", "é".encode() + b"l"]
    tokens = [bytes([b]) for b in range(256)] + merges
    path.mkdir()
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (path / "tiktoken.model").write_text("\n".join(lines), encoding="utf-8")
    specials = {"300": {"content": "[BOS]"}, "301": {"content": "[EOS]"}}
    config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "added_tokens_decoder": specials}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return Tokenizer.from_pretrained(path)


def build_metaspace(path: Path) -> Tokenizer:
    """SentencePiece-style: decode drops the space marker of the first token."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<s>"], show_progress=False)
    tok.train_from_iterator(["hello world", "world hello"] * 3, trainer)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return Tokenizer.from_pretrained(path)


@pytest.fixture(autouse=True)
def tiktoken_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))


@pytest.fixture(params=["hf", "tiktoken"])
def tok(request, tmp_path) -> Tokenizer:
    build = build_hf if request.param == "hf" else build_tiktoken
    return build(tmp_path / request.param)


@pytest.fixture
def hf(tmp_path) -> Tokenizer:
    return build_hf(tmp_path / "hf")


def stream(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [det.push(ids[i : i + chunk]).text for i in range(0, len(ids), chunk)]
    return [*deltas, det.flush()]


def test_multibyte_characters_span_tokens(tok):
    ids = tok.encode("你好 🙂")
    assert any(FFFD in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 3])
def test_real_text_never_emits_partial_characters(tok, chunk):
    for text in CORPUS:
        det = IncrementalDetokenizer(tok)
        deltas = stream(det, tok.encode(text), chunk)
        assert "".join(deltas) == text
        assert det.output_text == text
        assert not any(FFFD in d for d in deltas)


def byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One single-byte token per byte (both test vocabularies contain all 256 bytes)."""
    ids = [tok.token_to_id(_BYTE_TO_CHAR[b]) for b in data]
    assert None not in ids
    return ids


def random_ids(tok: Tokenizer, rng: random.Random, length: int) -> list[int]:
    """Mix of whole characters, characters split into byte tokens, cut-off and stray bytes."""
    chars = [ch.encode() for ch in "你好🙂😀日é a"]
    ordinary = [
        i
        for i in range(tok.vocab_size)
        if tok.id_to_token(i) is not None and i not in tok.special_token_ids
    ]
    ids: list[int] = []
    while len(ids) < length:
        kind, data = rng.random(), rng.choice(chars)
        if kind < 0.3:
            ids += tok.encode(data.decode())
        elif kind < 0.6:
            ids += byte_ids(tok, data)
        elif kind < 0.75:
            ids += byte_ids(tok, data[: rng.randrange(1, len(data) + 1)])
        elif kind < 0.85:
            ids += byte_ids(tok, bytes([rng.choice([0x80, 0xA0, 0xBF, 0xFF])]))
        else:
            ids.append(rng.choice(ordinary))
    return ids


def test_random_token_sequences_match_full_decode(tok):
    rng = random.Random(1234)
    for _ in range(400):
        ids = random_ids(tok, rng, rng.randint(1, 60))
        det = IncrementalDetokenizer(tok)
        deltas = stream(det, ids, rng.choice([1, 1, 2, 5]))
        assert "".join(deltas) == tok.decode(ids)


@pytest.mark.parametrize("char", ["你", "🙂"])
@pytest.mark.parametrize("n_invalid", range(9))
def test_long_invalid_run_before_split_character(tok, char, n_invalid):
    ids = byte_ids(tok, b"\xff" * n_invalid + char.encode()) + tok.encode("x")
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == FFFD * n_invalid + char + "x"


def test_held_lead_byte_resolved_as_invalid(hf):
    lead = hf.encode("你")[0]
    det = IncrementalDetokenizer(hf)
    assert det.push(hf.encode("a")).text == "a"
    assert det.push([lead]).text == ""
    assert det.push(hf.encode("x")).text == FFFD + "x"
    assert det.output_text == hf.decode([*hf.encode("a"), lead, *hf.encode("x")])


def test_window_stays_bounded_on_invalid_bytes(hf):
    sizes: list[int] = []
    decode = hf.decode

    def recording_decode(ids, skip_special_tokens=True):
        sizes.append(len(ids))
        return decode(ids, skip_special_tokens=skip_special_tokens)

    hf.decode = recording_decode
    lead = hf.encode("你")[0]  # a lead byte whose continuation never comes
    ids = [lead] * 500 + hf.encode("ok")
    det = IncrementalDetokenizer(hf)
    deltas = stream(det, ids)
    assert "".join(deltas) == decode(ids)
    assert max(sizes) <= 12


def test_prompt_context_keeps_leading_space(hf):
    prompt = hf.encode("你好 world")
    generated = hf.encode(" 🙂 wörld")
    det = IncrementalDetokenizer(hf, prompt_token_ids=prompt)
    assert "".join(stream(det, generated)) == " 🙂 wörld"


def test_prompt_context_keeps_sentencepiece_space(tmp_path):
    tok = build_metaspace(tmp_path / "sp")
    generated = tok.encode("world hello")
    assert tok.decode(generated) == "world hello"
    det = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("hello"))
    assert "".join(stream(det, generated)) == " world hello"


def test_special_tokens_skipped_or_kept(hf):
    ids = [*hf.encode("hi"), hf.eos_token_id, *hf.encode("yo")]
    assert "".join(stream(IncrementalDetokenizer(hf), ids)) == "hiyo"
    kept = IncrementalDetokenizer(hf, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "hi</s>yo"


def test_flush_emits_trailing_incomplete_character(hf):
    ids = [*hf.encode("ok"), hf.encode("你")[0]]
    det = IncrementalDetokenizer(hf)
    assert det.push(ids).text == "ok"
    assert det.flush() == FFFD
    assert det.output_text == hf.decode(ids) == "ok" + FFFD


# --- stop strings --------------------------------------------------------------------------


def char_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per byte-level piece of each character, so stop strings span tokens."""
    return [i for ch in text for i in tok.encode(ch)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    ids = char_ids(tok, "hello STOP world")
    det = IncrementalDetokenizer(tok, stop=["STOP"], include_stop_str_in_output=include)
    deltas = [det.push([i]) for i in ids]
    expected = "hello STOP" if include else "hello "
    hit = [d for d in deltas if d.stop_string is not None]
    assert hit[0].stop_string == "STOP"
    assert deltas.index(hit[0]) == len(char_ids(tok, "hello STOP")) - 1
    assert "".join(d.text for d in deltas) == expected
    assert det.output_text == expected
    assert (det.finished, det.stop_string) == (True, "STOP")
    assert det.push(tok.encode("more")) == DetokenizerDelta("", None)
    assert det.flush() == ""


def test_stop_string_inside_one_push_truncates(tok):
    det = IncrementalDetokenizer(tok, stop=["wör"])
    delta = det.push(tok.encode("héllo wörld 🙂"))
    assert delta == DetokenizerDelta("héllo ", "wör")


def test_stop_string_with_multibyte_characters(tok):
    det = IncrementalDetokenizer(tok, stop=["🙂🙂"])
    deltas = [det.push([i]) for i in tok.encode("你好世界 🙂🙂 héllo")]
    assert "".join(d.text for d in deltas) == "你好世界 "
    assert deltas[-1] == DetokenizerDelta("", None)


def test_possible_stop_prefix_is_held_then_flushed(tok):
    det = IncrementalDetokenizer(tok, stop=["STOP"])
    assert det.push(char_ids(tok, "ab ST")).text == "ab "
    assert det.output_text == "ab "
    assert det.flush() == "ST"
    assert det.output_text == "ab ST"
    assert det.stop_string is None


def test_held_prefix_released_when_it_diverges(tok):
    det = IncrementalDetokenizer(tok, stop=["STOP"])
    assert det.push(char_ids(tok, "xST")).text == "x"
    assert det.push(char_ids(tok, "O")).text == ""
    assert det.push(char_ids(tok, "X")).text == "STOX"
    assert det.push(char_ids(tok, "S")).text == ""
    assert det.push(char_ids(tok, "TOP")) == DetokenizerDelta("", "STOP")
    assert det.output_text == "xSTOX"


def test_stop_match_that_ends_first_wins(tok):
    det = IncrementalDetokenizer(tok, stop=["abc", "b"])
    assert det.push(tok.encode("xabc")) == DetokenizerDelta("xa", "b")
    det = IncrementalDetokenizer(tok, stop=["b", "ab"], include_stop_str_in_output=True)
    assert det.push(tok.encode("xabc")) == DetokenizerDelta("xab", "ab")


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, stop=["ok", ""])


@pytest.mark.parametrize("prompt", [[], [5, 40, 7]])
def test_deferred_text_equals_the_streamed_text(tok, prompt):
    """defer (no stream, no stop strings): nothing before flush, then the streamed text."""
    rng = random.Random(7)
    for _ in range(40):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        streamed = "".join(stream(IncrementalDetokenizer(tok, prompt), ids))
        det = IncrementalDetokenizer(tok, prompt, defer=True)
        deltas = stream(det, ids, chunk=rng.choice([1, 4]))
        assert all(d == "" for d in deltas[:-1])
        assert deltas[-1] == streamed == det.output_text


def test_defer_is_ignored_with_stop_strings(tok):
    det = IncrementalDetokenizer(tok, stop=["STOP"], defer=True)
    ids = tok.encode("hello STOP world")
    assert "".join(stream(det, ids)) == "hello " and det.stop_string == "STOP"
