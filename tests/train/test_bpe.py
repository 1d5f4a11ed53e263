from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
import tokenizers

from kdaserve.train.bpe import (
    CHAT_TEMPLATE,
    DEFAULT_SPECIALS,
    save_tokenizer,
    train_bpe_tokenizer,
)

CORPUS = [
    "ROMEO:\nBut soft! what light through yonder window breaks?\nIt is the east, and Juliet is "
    "the sun!\n",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name;\n",
    "HAMLET:\nTo be, or not to be,--that is the question:--\nWhether 'tis nobler in the mind "
    "to suffer\n",
    "KING:\nThe queen, the king, the crown: the thing is in the throne of the kingdom.\n",
] * 20
ROUND_TRIP_TEXTS = [
    "ROMEO:\nWhat, ho! apothecary!\n",
    "  leading and trailing spaces  \n\n\ttabs\r\nand CRLF\r\n",
    "Café, naïve, Ærøskøbing — “quoted” \u2018text\u2019 … ½ ° €",
    "日本語のテキスト, 中文, 한국어, Ελληνικά, русский, עברית, العربية",
    "emoji 🙂🎭👑 and e\u0301 combining, zero\u200bwidth, NUL\x00byte",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><|pad|>",
]
MESSAGES = [
    {"role": "system", "content": "You are Shakespeare."},
    {"role": "user", "content": "ROMEO:"},
    {"role": "assistant", "content": "But soft!"},
]
RENDERED = (
    "<|im_start|>system\nYou are Shakespeare.<|im_end|>\n"
    "<|im_start|>user\nROMEO:<|im_end|>\n"
    "<|im_start|>assistant\nBut soft!<|im_end|>\n"
)
GENERATION_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok() -> tokenizers.Tokenizer:
    return train_bpe_tokenizer(CORPUS, vocab_size=400)


@pytest.fixture(scope="module")
def saved_dir(tok: tokenizers.Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, out, model_max_length=1024)
    return out


def test_special_tokens_take_the_first_ids(tok: tokenizers.Tokenizer) -> None:
    assert [tok.token_to_id(s) for s in DEFAULT_SPECIALS] == [0, 1, 2, 3]
    added = tok.get_added_tokens_decoder()
    assert {i: (t.content, t.special) for i, t in added.items()} == {
        i: (s, True) for i, s in enumerate(DEFAULT_SPECIALS)
    }


def test_specials_in_text_encode_as_single_ids(tok: tokenizers.Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and 0 not in ids[1:-1] and 3 not in ids


def test_training_learns_merges(tok: tokenizers.Tokenizer) -> None:
    vocab = tok.get_vocab()
    assert 256 + len(DEFAULT_SPECIALS) < len(vocab) <= 400
    assert tok.encode(" Romeo").tokens == ["ĠRomeo"]
    assert tok.encode(" the").tokens == ["Ġthe"]


def test_training_is_deterministic(tok: tokenizers.Tokenizer) -> None:
    assert train_bpe_tokenizer(CORPUS, vocab_size=400).to_str() == tok.to_str()


def test_custom_specials_keep_their_order() -> None:
    specials = ("<b>", "<a>")
    tok = train_bpe_tokenizer(CORPUS, vocab_size=300, special_tokens=specials)
    assert [tok.token_to_id(s) for s in specials] == [0, 1]


@pytest.mark.parametrize(
    ("vocab_size", "specials"), [(259, DEFAULT_SPECIALS), (300, ("<a>", "<a>"))]
)
def test_rejects_bad_arguments(vocab_size: int, specials: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        train_bpe_tokenizer(CORPUS, vocab_size=vocab_size, special_tokens=specials)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip_is_exact(tok: tokenizers.Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_saved_config(saved_dir: Path) -> None:
    assert sorted(p.name for p in saved_dir.iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((saved_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    flags = {"special": True, "lstrip": False, "rstrip": False, "normalized": False}
    assert config == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": s, **flags, "single_word": False}
            for i, s in enumerate(DEFAULT_SPECIALS)
        },
    }


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_saved_tokenizer_json_round_trips(
    tok: tokenizers.Tokenizer, saved_dir: Path, text: str
) -> None:
    loaded = tokenizers.Tokenizer.from_file(str(saved_dir / "tokenizer.json"))
    ids = loaded.encode(text).ids
    assert ids == tok.encode(text).ids
    assert loaded.decode(ids, skip_special_tokens=False) == text


def test_save_requires_eos_and_pad(tmp_path: Path) -> None:
    tok = train_bpe_tokenizer(CORPUS, vocab_size=300, special_tokens=("<|endoftext|>",))
    with pytest.raises(ValueError, match="<\\|pad\\|>"):
        save_tokenizer(tok, tmp_path)


def test_transformers_loads_the_saved_dir(tok: tokenizers.Tokenizer, saved_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(saved_dir)
    assert (hf.bos_token, hf.eos_token_id, hf.pad_token_id) == (None, 0, 3)
    assert hf.model_max_length == 1024
    for text in ROUND_TRIP_TEXTS:
        ids = tok.encode(text).ids
        assert hf.encode(text) == ids
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids) == text
    assert hf.apply_chat_template(MESSAGES, tokenize=False) == RENDERED
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == RENDERED + GENERATION_PROMPT


def test_kdaserve_tokenizer_loads_the_saved_dir(saved_dir: Path) -> None:
    from kdaserve.tokenizer import Tokenizer

    loaded = Tokenizer.from_pretrained(saved_dir)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (None, 0, 3)
    assert loaded.apply_chat_template(MESSAGES) == RENDERED + GENERATION_PROMPT
    assert loaded.apply_chat_template(MESSAGES, add_generation_prompt=False) == RENDERED


@pytest.mark.parametrize("trim", [False, True])
def test_chat_template_renders_chatml(trim: bool) -> None:
    env = jinja2.Environment(trim_blocks=trim, lstrip_blocks=trim)
    template = env.from_string(CHAT_TEMPLATE)
    assert template.render(messages=MESSAGES, add_generation_prompt=False) == RENDERED
    assert template.render(messages=MESSAGES[1:2], add_generation_prompt=True) == (
        "<|im_start|>user\nROMEO:<|im_end|>\n" + GENERATION_PROMPT
    )
