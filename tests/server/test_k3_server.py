"""A Kimi K3 checkpoint (released layout, MXFP4 experts) with a tiktoken tokenizer and a Kimi
chat template: text and chat through the real server and the `openai` client, with n-gram
speculation on; the server's greedy text equals offline generation; the draft-training pipeline
(extract-hidden, train-draft) runs on the K3 target."""

from __future__ import annotations

import json

import openai
import pytest

from k3_models import k3_raw, write_k3_checkpoint
from kdaserve import LLM, SamplingParams
from server_harness import start_server
from test_tokenizer import make_tiktoken_dir

SPECIALS = {"[BOS]": 274, "[EOS]": 275, "<|im_end|>": 276, "<|im_user|>": 277,
            "<|im_assistant|>": 278, "<|im_system|>": 279, "<|im_middle|>": 280}
TEMPLATE = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
            "{{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")


@pytest.fixture(scope="module")
def k3_text_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3_tiktoken")
    make_tiktoken_dir(out, added_tokens_decoder={str(i): {"content": s, "special": True}
                                                 for s, i in SPECIALS.items()},
                      eos_token="<|im_end|>", chat_template=TEMPLATE)
    raw = k3_raw(mxfp4=True, vocab_size=288, eos_token_id=276)
    raw["media_placeholder_token_id"] = 287
    write_k3_checkpoint(out, raw, seed=11)
    return out


def test_k3_text_and_chat_over_http(k3_text_dir, tmp_path):
    offline = LLM(str(k3_text_dir)).generate(
        "hello world", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    srv = start_server(k3_text_dir, tmp_path / "server.log", "--torch-threads", "1",
                       "--speculative-method", "ngram", "--speculative-tokens", "3",
                       "--cache-memory", "64MiB", "--max-model-len", "512")
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        comp = client.completions.create(model=client.models.list().data[0].id,
                                         prompt="hello world", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert comp.choices[0].text == offline
        chat = client.chat.completions.create(
            model=comp.model, messages=[{"role": "user", "content": "你好 world"}],
            max_tokens=8, temperature=0.7, seed=1)
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage.prompt_tokens > 5
        stream = client.chat.completions.create(
            model=comp.model, messages=[{"role": "user", "content": "hello"}],
            max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1
        assert "kimi_k3" in srv.log() and "bytes per weight" in srv.log()
    finally:
        assert srv.stop() == 0


def test_draft_training_on_k3_target(k3_text_dir, tmp_path):
    from kdaserve.model.registry import load_draft
    from kdaserve.train.draft import train_draft
    from kdaserve.train.draft_data import extract_hidden

    text = tmp_path / "corpus.txt"
    text.write_text("hello world 你好 hell world hello " * 30)
    meta = extract_hidden(str(k3_text_dir), str(text), str(tmp_path / "hid"), prompt_len=8,
                          generate=8, max_seqs=4, batch=2, layers=(1, 4))
    assert meta["num_sequences"] == 4
    report = train_draft(str(k3_text_dir), str(tmp_path / "hid"), str(tmp_path / "d"),
                         steps=2, batch=2, anchors=2, block=4)
    # the report's figures agree with each other (their values on known logits:
    # tests/train/test_draft_acceptance.py)
    assert report["block_size"] == 4
    assert report["heldout_acceptance_rate"] == pytest.approx(report["heldout_mean_accepted"] / 4)
    assert report["heldout_sampled_acceptance_rate"] == pytest.approx(
        report["heldout_sampled_mean_accepted"] / 4)
    # a block's sampled run cannot outlast its first draft: Π_(i<=j) α_i <= α_0
    assert report["heldout_sampled_acceptance_rate"] <= report["heldout_sampled_first_draft"] + 1e-6
    assert json.loads((tmp_path / "d" / "config.json").read_text())["target_layer_ids"] == [1, 4]
    draft_dir = tmp_path / "d"
    load_draft(draft_dir)
    llm = LLM(str(k3_text_dir), speculative_method="dspark", num_speculative_tokens=3,
              speculative_model=str(draft_dir))
    base = LLM(str(k3_text_dir))
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(["hello world"], sp, use_tqdm=False)] \
        == [o.outputs[0].token_ids for o in base.generate(["hello world"], sp, use_tqdm=False)]
