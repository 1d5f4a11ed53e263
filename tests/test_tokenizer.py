from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kdaserve.tiktoken_backend import KIMI_PAT_STR, KIMI_PAT_STR_FALLBACK, _build_encoding
from kdaserve.tokenizer import Tokenizer

TEXTS = [
    "héllo wörld 你好 🙂",
    "hello world, hello tokenizer",
    "你好世界 🙂🙂 wörld",
    "the quick brown fox jumps over the lazy dog",
]
HF_SPECIALS = ["<s>", "</s>", "<pad>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
)


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


def make_hf_dir(path: Path, vocab_size: int = 300, **config: object) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=HF_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 5, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    defaults = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "pad_token": {"content": "<pad>"},
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }
    write_json(path / "tokenizer_config.json", {**defaults, **config})
    return path


MERGES = [
    b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world",
    "你".encode()[:2], "你".encode(), "好".encode()[:2], "好".encode(), "你好".encode(),
    "a你".encode(), b"\xf0\x9f", b"\xf0\x9f\x99", "🙂".encode(),
]  # fmt: skip
TIKTOKEN_SPECIALS = {"[BOS]": 274, "[EOS]": 275, "<|im_end|>": 276, "<|im_user|>": 280}


def rank_of(token: bytes) -> int:
    return 256 + MERGES.index(token)


def make_tiktoken_dir(path: Path, merges: list[bytes] = MERGES, **config: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([b]) for b in range(256)] + merges
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n", encoding="utf-8")
    decoder = {str(i): {"content": s, "special": True} for s, i in TIKTOKEN_SPECIALS.items()}
    defaults = {"bos_token": "[BOS]", "eos_token": "[EOS]", "added_tokens_decoder": decoder}
    write_json(path / "tokenizer_config.json", {**defaults, **config})
    return path


@pytest.fixture(autouse=True)
def tiktoken_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))


@pytest.fixture
def hf(tmp_path) -> Tokenizer:
    return Tokenizer.from_pretrained(make_hf_dir(tmp_path / "hf"))


@pytest.fixture
def tik(tmp_path) -> Tokenizer:
    return Tokenizer.from_pretrained(make_tiktoken_dir(tmp_path / "tik"))


# --- HF tokenizer.json ---------------------------------------------------------------------


@pytest.mark.parametrize("text", [*TEXTS, "", "  leading spaces", "mixed 你 and 🙂\n\nlines"])
def test_hf_round_trip(hf, text):
    assert hf.decode(hf.encode(text)) == text


def test_hf_special_token_ids(hf):
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    assert hf.eos_token_ids == frozenset({1})
    assert hf.special_token_ids == frozenset({0, 1, 2, 3})
    assert hf.vocab_size == 300
    assert hf.token_to_id("<|im_end|>") == 3
    assert hf.id_to_token(0) == "<s>"
    assert hf.token_to_id("no-such-token") is None
    assert hf.id_to_token(10_000) is None


def test_hf_specials_in_text(hf):
    ids = hf.encode("hello</s>world<|im_end|>")
    assert ids[len(hf.encode("hello"))] == 1
    assert ids[-1] == 3
    assert hf.decode(ids) == "helloworld"
    assert hf.decode(ids, skip_special_tokens=False) == "hello</s>world<|im_end|>"


def test_hf_add_special_tokens_prepends_bos(hf, tmp_path):
    assert hf.encode("hello", add_special_tokens=True) == [0, *hf.encode("hello")]
    no_bos = Tokenizer.from_pretrained(make_hf_dir(tmp_path / "nobos", add_bos_token=False))
    assert no_bos.encode("hello", add_special_tokens=True) == no_bos.encode("hello")


def test_hf_decode_drops_unknown_ids(hf):
    assert hf.decode([*hf.encode("hi"), 10_000]) == "hi"


def test_extra_eos_ids_from_generation_and_model_config(tmp_path):
    path = make_hf_dir(tmp_path / "hf")
    write_json(path / "generation_config.json", {"eos_token_id": [3, 1]})
    write_json(path / "config.json", {"eos_token_id": 2})
    tok = Tokenizer.from_pretrained(path)
    assert tok.eos_token_id == 1
    assert tok.eos_token_ids == frozenset({1, 2, 3})


def test_eos_from_generation_config_when_tokenizer_config_has_none(tmp_path):
    path = make_hf_dir(tmp_path / "hf", eos_token=None)
    write_json(path / "generation_config.json", {"eos_token_id": [3, 1]})
    tok = Tokenizer.from_pretrained(path)
    assert tok.eos_token_id == 3
    assert tok.eos_token_ids == frozenset({1, 3})


def test_invalid_eos_config_rejected(tmp_path):
    path = make_hf_dir(tmp_path / "hf")
    write_json(path / "config.json", {"eos_token_id": "</s>"})
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_pretrained(path)


def test_tokenizer_json_without_config(tmp_path):
    path = make_hf_dir(tmp_path / "hf")
    (path / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_pretrained(path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.chat_template) == (None, None, None)
    assert tok.eos_token_ids == frozenset()
    assert tok.special_token_ids == frozenset({0, 1, 2, 3})


# --- chat template -------------------------------------------------------------------------


def test_chat_template_renders(hf):
    messages = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "你好"}]
    assert hf.apply_chat_template(messages) == (
        "<s>[system]be nice<|im_end|>[user]你好<|im_end|>[assistant]"
    )
    assert hf.apply_chat_template(messages, add_generation_prompt=False) == (
        "<s>[system]be nice<|im_end|>[user]你好<|im_end|>"
    )


def test_chat_template_joins_text_parts_and_passes_kwargs(hf):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b<&>"}]
    out = hf.apply_chat_template([{"role": "user", "content": parts}], tools=[{"n": "é<"}])
    assert out == '<s>[user]a\nb<&><|im_end|>[assistant][{"n": "é<"}]'


def test_chat_template_tool_call_message_without_content(hf):
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]
    assert hf.apply_chat_template(messages, add_generation_prompt=False) == (
        "<s>[assistant]<|im_end|>"
    )


def test_chat_template_raise_exception_becomes_value_error(hf):
    with pytest.raises(ValueError, match="role bad is not allowed"):
        hf.apply_chat_template([{"role": "bad", "content": "x"}])


def test_chat_template_strftime_now(tmp_path):
    path = make_hf_dir(tmp_path / "hf", chat_template="{{ strftime_now('%Y') | length }}")
    tok = Tokenizer.from_pretrained(path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "4"


def test_chat_template_is_sandboxed(tmp_path):
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_pretrained(make_hf_dir(tmp_path / "hf", chat_template=template))
    with pytest.raises(ValueError, match="chat template error"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_file_fallback(tmp_path):
    path = make_hf_dir(tmp_path / "hf", chat_template=None)
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    tok = Tokenizer.from_pretrained(path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_default_chat_template(tmp_path):
    tok = Tokenizer.from_pretrained(make_hf_dir(tmp_path / "hf", chat_template=None))
    assert tok.chat_template is None
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tok.apply_chat_template(messages) == "<|system|>\ns\n<|user|>\nu\n<|assistant|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|system|>\ns\n<|user|>\nu\n"
    )


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "non-empty list"),
        ({"role": "user", "content": "x"}, "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "x"}], r"messages\[0\] needs a string 'role'"),
        ([{"role": 1, "content": "x"}], r"messages\[0\] needs a string 'role'"),
        ([{"role": "user"}], r"messages\[0\] needs a 'content'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\]"),
        ([{"role": "user", "content": None}], r"must be a string or a list"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"\['content'\]\[0\]"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"\['text'\] must be"),
    ],
)
def test_chat_message_validation(hf, messages, error):
    with pytest.raises(ValueError, match=error):
        hf.apply_chat_template(messages)


# --- tiktoken.model ------------------------------------------------------------------------


@pytest.mark.parametrize("text", [*TEXTS, "", "a你好b 🙂🙂\n\n  x", "[BOS] is special"])
def test_tiktoken_round_trip(tik, text):
    assert tik.decode(tik.encode(text)) == text.replace("[BOS]", "")


def test_tiktoken_merges_and_han_split(tik):
    assert tik.encode("hello world") == [rank_of(b"hello"), rank_of(b" world")]
    assert tik.encode("你好") == [rank_of("你好".encode())]
    # "a你" is a rank, but the pattern splits Han from Latin letters before merging.
    assert tik.encode("a你") == [ord("a"), rank_of("你".encode())]
    assert tik.encode("🙂") == [rank_of("🙂".encode())]


def test_tiktoken_special_tokens(tik):
    assert tik.vocab_size == 281
    assert (tik.bos_token_id, tik.eos_token_id, tik.pad_token_id) == (274, 275, None)
    assert tik.eos_token_ids == frozenset({275})
    assert tik.special_token_ids == frozenset(TIKTOKEN_SPECIALS.values())
    ids = tik.encode("[BOS]hello<|im_user|>你好<|im_end|>")
    assert ids == [274, rank_of(b"hello"), 280, rank_of("你好".encode()), 276]
    assert tik.decode(ids) == "hello你好"
    assert tik.decode(ids, skip_special_tokens=False) == "[BOS]hello<|im_user|>你好<|im_end|>"
    assert tik.decode([277, 1000, *tik.encode("x")]) == "x"


def test_tiktoken_bos_on_request(tmp_path):
    tok = Tokenizer.from_pretrained(make_tiktoken_dir(tmp_path / "t", add_bos_token=True))
    assert tok.encode("hello", add_special_tokens=True) == [274, rank_of(b"hello")]
    assert tok.encode("hello") == [rank_of(b"hello")]


def test_tiktoken_token_strings(tik):
    assert tik.id_to_token(rank_of(b" world")) == "Ġworld"
    assert tik.id_to_token(276) == "<|im_end|>"
    assert tik.id_to_token(277) is None
    assert tik.token_to_id("Ġworld") == rank_of(b" world")
    assert tik.token_to_id(" world") == rank_of(b" world")
    assert tik.token_to_id("你好") == rank_of("你好".encode())
    assert tik.token_to_id("<|im_user|>") == 280
    assert tik.token_to_id("zzz") is None


def test_tiktoken_very_long_runs(tik):
    text = " " * 1_000_000 + "x" * 100_000
    ids = tik.encode(text)
    assert len(ids) == 1_100_000
    assert tik.decode(ids) == text


def test_tiktoken_reload_after_file_changes(tmp_path):
    path = make_tiktoken_dir(tmp_path / "t")
    assert Tokenizer.from_pretrained(path).encode("hello") == [rank_of(b"hello")]
    make_tiktoken_dir(path, merges=[b"he", b"ll", b"hell"])
    assert Tokenizer.from_pretrained(path).encode("hello") == [258, ord("o")]


def test_tiktoken_special_id_collision(tmp_path):
    decoder = {"3": {"content": "[BAD]"}}
    path = make_tiktoken_dir(tmp_path / "t", added_tokens_decoder=decoder)
    with pytest.raises(ValueError, match="collide"):
        Tokenizer.from_pretrained(path)


def test_fallback_pattern_splits_like_kimi_pattern():
    ranks = {bytes([b]): b for b in range(256)} | {t: rank_of(t) for t in MERGES}
    primary = _build_encoding("p", ranks, {})
    fallback = _build_encoding("f", ranks, {}, ("([unclosed", KIMI_PAT_STR_FALLBACK))
    assert (primary._pat_str, fallback._pat_str) == (KIMI_PAT_STR, KIMI_PAT_STR_FALLBACK)
    for text in [*TEXTS, "a你 b你好c HELLO world's 你a", "x🙂你好 1234567 \n\n  y"]:
        assert fallback.encode_ordinary(text) == primary.encode_ordinary(text)
    assert fallback.encode_ordinary("a你") == [ord("a"), rank_of("你".encode())]


def test_build_encoding_rejects_bad_patterns():
    with pytest.raises(ValueError, match="rejected every split pattern"):
        _build_encoding("x", {bytes([b]): b for b in range(256)}, {}, ("([", "(?<"))


# --- missing files -------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="directory does not exist") as info:
        Tokenizer.from_pretrained(missing)
    assert str(missing) in str(info.value)
    assert "tokenizer.json" in str(info.value) and "tiktoken.model" in str(info.value)


def test_directory_without_tokenizer_file(tmp_path):
    write_json(tmp_path / "tokenizer_config.json", {"eos_token": "</s>"})
    with pytest.raises(FileNotFoundError, match="no tokenizer file") as info:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "tokenizer.json or tiktoken.model" in str(info.value)
