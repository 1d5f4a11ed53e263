"""The OpenAI API end to end: the real uvicorn server in a subprocess, driven by `openai`."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_harness import (
    BODY_LIMIT,
    MAX_MODEL_LEN,
    assert_openai_error,
    metrics,
    torch_threads,
    wait_idle,
)

from kdaserve import LLM, SamplingParams
from kdaserve.tokenizer import Tokenizer

PROMPT = "The king and the queen of the sea"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(tiny_model_dir):
    return tiny_model_dir.name


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with torch_threads(1):
        return LLM(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, cache_memory=64 << 20)


def offline(llm, prompt, **kw):
    """The offline engine's greedy output for a text or token-id prompt."""
    sp = SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)
    item = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    with torch_threads(1):
        return llm.generate(item, sp, use_tqdm=False)[0].outputs[0]


def complete(client, model_name, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0.0)
    extra = {k: kw.pop(k) for k in ("ignore_eos", "return_token_ids", "top_k",
                                    "return_tokens_as_token_ids", "stop_token_ids") if k in kw}
    return client.completions.create(model=model_name, prompt=prompt, extra_body=extra, **kw)


def still_serves(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2,
                                                   "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


# ---- basics ---------------------------------------------------------------------------------
def test_models(client, server, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    raw = httpx.get(server.base_url + "/models").json()
    assert raw["object"] == "list"
    assert raw["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert raw["data"][0]["object"] == "model"


def test_health(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_startup_logs_cache_plan(server):
    assert "tokens of MLA cache" in server.log()
    assert "state slots" in server.log()


def test_completion_greedy_matches_offline(client, model_name, llm):
    resp = complete(client, model_name, return_token_ids=True)
    ref = offline(llm, PROMPT)
    [choice] = resp.choices
    assert choice.token_ids == ref.token_ids
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.object == "text_completion"
    assert resp.model == model_name


def test_token_id_prompt_matches_offline(client, model_name, llm, tokenizer):
    ids = tokenizer.encode("Love and light and night") + [7, 100, 250]
    resp = complete(client, model_name, prompt=ids, return_token_ids=True, ignore_eos=True)
    ref = offline(llm, ids, ignore_eos=True)
    assert resp.choices[0].token_ids == ref.token_ids
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == MAX_TOKENS
    assert resp.usage.total_tokens == len(ids) + MAX_TOKENS
    assert resp.choices[0].finish_reason == "length"


def test_chat_matches_offline(client, model_name, llm, tokenizer):
    messages = [{"role": "system", "content": "Speak like a king."},
                {"role": "user", "content": "What of the night?"}]
    resp = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8,
                                          temperature=0.0,
                                          extra_body={"ignore_eos": True,
                                                      "return_token_ids": True})
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    ref = offline(llm, ids, max_tokens=8, ignore_eos=True)
    [choice] = resp.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 8
    assert resp.object == "chat.completion"


def test_chat_default_max_tokens_fills_context(server, tokenizer):
    """Without max_tokens a chat may use what is left of max_model_len; too long is a 400."""
    def num_tokens(content: str) -> int:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        return len(tokenizer.encode(text))

    unit = next(w for w in (" a", " the", " and", " of", " to") if len(tokenizer.encode(w)) == 1)
    repeat = MAX_MODEL_LEN - 1 - num_tokens("")
    assert num_tokens(unit * repeat) == MAX_MODEL_LEN - 1
    url = server.base_url + "/chat/completions"
    r = httpx.post(url, timeout=120, json={
        "messages": [{"role": "user", "content": unit * repeat}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
    assert r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN
    r = httpx.post(url, timeout=120, json={
        "messages": [{"role": "user", "content": unit * (repeat + 1)}]})
    assert_openai_error(r, 400, "context_length_exceeded")


# ---- streaming --------------------------------------------------------------------------------
def test_stream_completion_concatenates_to_nonstream(client, model_name):
    full = complete(client, model_name, ignore_eos=True)
    chunks = list(complete(client, model_name, ignore_eos=True, stream=True,
                           stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_chat_role_first_and_same_text(client, model_name):
    messages = [{"role": "user", "content": "Sing of the moon"}]
    kw = dict(model=model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1


def test_stream_raw_sse_ends_with_done(server):
    with httpx.stream("POST", server.base_url + "/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


# ---- sampling options ---------------------------------------------------------------------------
def test_n_and_seed(client, model_name):
    kw = dict(n=3, temperature=1.0, seed=1234, max_tokens=4, ignore_eos=True)
    a = complete(client, model_name, **kw)
    b = complete(client, model_name, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 12
    assert {c.finish_reason for c in a.choices} == {"length"}


def test_n_greedy_and_several_prompts(client, model_name):
    other = "Night and day"
    resp = complete(client, model_name, prompt=[PROMPT, other], n=2, ignore_eos=True,
                    max_tokens=5)
    first = complete(client, model_name, prompt=PROMPT, ignore_eos=True, max_tokens=5)
    second = complete(client, model_name, prompt=other, ignore_eos=True, max_tokens=5)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [first.choices[0].text] * 2 + \
        [second.choices[0].text] * 2
    assert resp.usage.prompt_tokens == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert resp.usage.completion_tokens == 20


def test_stream_n_choices(client, model_name):
    chunks = list(complete(client, model_name, n=2, ignore_eos=True, max_tokens=4, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    greedy = complete(client, model_name, ignore_eos=True, max_tokens=4).choices[0].text
    assert texts == {0: greedy, 1: greedy}


def test_stop_string(client, model_name):
    full = complete(client, model_name, ignore_eos=True, max_tokens=16).choices[0].text
    at = next(i for i, ch in enumerate(full)
              if i > 0 and ch.isascii() and ch.isprintable() and full.find(ch) == i)
    resp = complete(client, model_name, ignore_eos=True, max_tokens=16, stop=[full[at]])
    [choice] = resp.choices
    assert choice.text == full[:at]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == full[at]


def test_stop_token_ids(client, model_name):
    ids = complete(client, model_name, ignore_eos=True, return_token_ids=True).choices[0].token_ids
    stop = ids[2]
    resp = complete(client, model_name, ignore_eos=True, return_token_ids=True,
                    stop_token_ids=[stop])
    cut = ids.index(stop) + 1
    assert resp.choices[0].token_ids == ids[:cut]
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == cut


def test_echo(client, model_name):
    plain = complete(client, model_name, max_tokens=4, ignore_eos=True).choices[0].text
    echoed = complete(client, model_name, max_tokens=4, ignore_eos=True, echo=True, user="me")
    assert echoed.choices[0].text == PROMPT + plain
    chunks = list(complete(client, model_name, max_tokens=4, ignore_eos=True, echo=True,
                           stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain


def test_echo_with_logprobs_scores_the_prompt(client, model_name, llm, tokenizer):
    """echo + logprobs: the prompt's tokens come first with their logprobs (the first None),
    equal to the offline engine's prompt_logprobs (tested there against a full forward)."""
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    with torch_threads(1):
        ref = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                  logprobs=2, prompt_logprobs=2),
                           use_tqdm=False)[0]
    gen = ref.outputs[0].token_ids
    resp = complete(client, model_name, echo=True, logprobs=2, max_tokens=3, ignore_eos=True,
                    return_tokens_as_token_ids=True)
    lp = resp.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids + gen]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref.prompt_logprobs[i][t] for i, t in enumerate(ids) if i] + [
        d[t] for d, t in zip(ref.outputs[0].logprobs, gen)]
    assert lp.token_logprobs[1:] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    assert resp.choices[0].text.startswith(PROMPT)
    chunks = list(complete(client, model_name, echo=True, logprobs=2, max_tokens=3,
                           ignore_eos=True, stream=True, return_tokens_as_token_ids=True))
    assert chunks[0].choices[0].text == PROMPT
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_prompt_logprobs_extra(client, model_name, llm, tokenizer):
    """vLLM's prompt_logprobs: per prompt position (None first) the prompt token's logprob and
    the top alternatives, on completions (per choice) and chat (per response); no streams."""
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    with torch_threads(1):
        ref = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1,
                                                  prompt_logprobs=2), use_tqdm=False)[0]
    resp = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1,
                                     temperature=0.0, extra_body={"prompt_logprobs": 2})
    got = resp.model_extra.get("prompt_logprobs") or resp.choices[0].model_extra[
        "prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i, t in enumerate(ids[1:], 1):
        assert got[i][str(t)]["logprob"] == pytest.approx(ref.prompt_logprobs[i][t],
                                                          rel=1e-5, abs=1e-6)
        assert len(got[i]) >= 2 and all(e["decoded_token"] is not None
                                        for e in got[i].values())
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hello"}], max_tokens=1,
        extra_body={"prompt_logprobs": 1})
    lps = chat.model_extra["prompt_logprobs"]
    assert lps[0] is None and all(isinstance(d, dict) and d for d in lps[1:])
    with pytest.raises(openai.BadRequestError) as e:
        list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1,
                                       stream=True, extra_body={"prompt_logprobs": 1}))
    assert "prompt_logprobs" in str(e.value)


def test_completion_logprobs_match_offline(client, model_name, llm):
    resp = complete(client, model_name, logprobs=2, max_tokens=5, ignore_eos=True,
                    return_token_ids=True, return_tokens_as_token_ids=True)
    ref = offline(llm, PROMPT, max_tokens=5, ignore_eos=True, logprobs=2)
    lp = resp.choices[0].logprobs
    ids = resp.choices[0].token_ids
    assert ids == ref.token_ids
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert lp.token_logprobs == pytest.approx([d[t] for d, t in zip(ref.logprobs, ids)],
                                              rel=1e-5, abs=1e-6)
    for got, want in zip(lp.top_logprobs, ref.logprobs):
        assert got == pytest.approx({f"token_id:{t}": v for t, v in want.items()},
                                    rel=1e-5, abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_chat_logprobs(client, model_name):
    resp = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hail"}], max_tokens=4,
        temperature=0.0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, values[0])
        assert entry.bytes == list(entry.token.encode("utf-8", "replace"))


def test_stream_logprobs(client, model_name):
    chunks = list(complete(client, model_name, logprobs=1, max_tokens=4, ignore_eos=True,
                           stream=True, return_tokens_as_token_ids=True))
    streamed = [t for c in chunks if c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens]
    full = complete(client, model_name, logprobs=1, max_tokens=4, ignore_eos=True,
                    return_tokens_as_token_ids=True)
    assert streamed == full.choices[0].logprobs.tokens


# ---- tokenizer endpoints -------------------------------------------------------------------------
def test_tokenize_and_detokenize(server, tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200
    body = r.json()
    assert body == {"tokens": tokenizer.encode(PROMPT), "count": len(tokenizer.encode(PROMPT)),
                    "max_model_len": MAX_MODEL_LEN}
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200
    assert back.json() == {"prompt": PROMPT}


def test_tokenize_messages(server, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages})
    assert r.status_code == 200
    assert r.json()["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages))


# ---- metrics and load ----------------------------------------------------------------------------
def test_metrics_count_one_request(server):
    before = wait_idle(server.url)
    prompt = [11, 12, 13, 14, 15, 16, 17]    # shorter than a block: no prefix-cache hit
    r = httpx.post(server.base_url + "/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    after = metrics(server.url)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("kdaserve:generation_tokens_total") == 5
    assert grew("kdaserve:prompt_tokens_total") == 7
    assert grew("kdaserve:e2e_request_latency_seconds_count") == 1
    assert grew("kdaserve:time_to_first_token_seconds_count") == 1
    assert grew("kdaserve:time_per_output_token_seconds_count") == 1
    assert grew('kdaserve:request_success_total{finished_reason="length"}') == 1
    assert after["kdaserve:engine_up"] == 1
    assert after["kdaserve:cache_usage"] == 0.0
    assert after["kdaserve:cache_free_blocks"] == after["kdaserve:cache_num_blocks"] > 0


def test_64_concurrent_streams(server, model_name):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=model_name, prompt=f"{PROMPT} {i}", max_tokens=4, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        reason, tokens = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return reason, tokens

    async def main() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(main()) == [("length", 4)] * 64
    m = metrics(server.url)
    assert m["kdaserve:cache_all_free"] == 1.0
    assert m["kdaserve:num_requests_running"] == 0
    assert m["kdaserve:num_requests_waiting"] == 0
    assert m["kdaserve:prefix_cache_queries_total"] >= 64       # every request looked the cache up
    assert m["kdaserve:state_snapshots"] >= 1
    assert m["kdaserve:state_snapshot_bytes"] > 0


def test_disconnect_aborts_request(server):
    before = wait_idle(server.url)
    max_tokens = MAX_MODEL_LEN - 20
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: {")
            if events == 2:
                break
    after = wait_idle(server.url)
    assert after["kdaserve:request_aborted_total"] - before["kdaserve:request_aborted_total"] == 1
    generated = after["kdaserve:generation_tokens_total"] - before[
        "kdaserve:generation_tokens_total"]
    assert 2 <= generated < max_tokens
    still_serves(server.url)


# ---- errors --------------------------------------------------------------------------------------
BAD_COMPLETIONS = {
    "max_tokens_zero": ({"max_tokens": 0}, None),
    "max_tokens_negative": ({"max_tokens": -3}, None),
    "temperature_negative": ({"temperature": -0.5}, None),
    "temperature_too_high": ({"temperature": 1000.0}, None),
    "top_p_zero": ({"top_p": 0.0}, None),
    "n_zero": ({"n": 0}, None),
    "logprobs_too_many": ({"logprobs": 50}, None),
    "unknown_model": ({"model": "gpt-17"}, "model_not_found"),
    "too_long": ({"max_tokens": MAX_MODEL_LEN}, "context_length_exceeded"),
    "empty_prompt": ({"prompt": ""}, None),
    "empty_prompt_list": ({"prompt": []}, None),
    "empty_token_list": ({"prompt": [[]]}, None),
    "token_out_of_vocab": ({"prompt": [5, 10**6]}, None),
    "max_tokens_string": ({"max_tokens": "5"}, None),
    "max_tokens_bool": ({"max_tokens": True}, None),
    "prompt_number": ({"prompt": 5}, None),
    "temperature_string": ({"temperature": "hot"}, None),
    "stop_number": ({"stop": 3}, None),
    "stream_options_without_stream": ({"stream_options": {"include_usage": True}}, None),
    "prompt_missing": ({"prompt": None}, None),
}


@pytest.mark.parametrize("case", sorted(BAD_COMPLETIONS))
def test_bad_completion_is_400(server, case):
    change, code = BAD_COMPLETIONS[case]
    body = {"prompt": PROMPT, "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert_openai_error(r, 400, code)
    r = httpx.post(server.base_url + "/completions", json={**body, "stream": True}, timeout=60)
    if "stream_options" not in body:
        assert_openai_error(r, 400, code)
    still_serves(server.url)


BAD_CHATS = {
    "empty_messages": {"messages": []},
    "messages_string": {"messages": "hi"},
    "message_without_role": {"messages": [{"content": "hi"}]},
    "message_content_number": {"messages": [{"role": "user", "content": 5}]},
    "top_logprobs_without_logprobs": {"top_logprobs": 2},
    "unknown_model": {"model": "nope"},
    "max_completion_tokens_zero": {"max_completion_tokens": 0},
}


@pytest.mark.parametrize("case", sorted(BAD_CHATS))
def test_bad_chat_is_400(server, case):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **BAD_CHATS[case]}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert_openai_error(r, 400)
    still_serves(server.url)


def test_openai_client_raises_bad_request(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model_name, max_tokens=-1)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b'{"prompt": "a",}'])
def test_malformed_json_is_400(server, raw):
    r = httpx.post(server.base_url + "/completions", content=raw,
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    still_serves(server.url)


def test_bad_tokenizer_requests_are_400(server):
    assert_openai_error(httpx.post(server.url + "/tokenize", json={}), 400)
    assert_openai_error(httpx.post(server.url + "/tokenize",
                                   json={"prompt": "a", "messages": []}), 400)
    assert_openai_error(httpx.post(server.url + "/detokenize", json={"tokens": [-1]}), 400)
    assert_openai_error(httpx.post(server.url + "/detokenize", json={"tokens": "abc"}), 400)
    still_serves(server.url)


def test_unknown_route_is_404(server):
    err = assert_openai_error(httpx.get(server.base_url + "/nothing-here"), 404)
    assert err["type"] == "not_found_error"
    assert_openai_error(httpx.get(server.base_url + "/completions"), 405)
    still_serves(server.url)


def test_body_over_limit_is_413(server):
    big = {"prompt": "x" * (BODY_LIMIT + 1), "max_tokens": 1}
    assert_openai_error(httpx.post(server.base_url + "/completions", json=big), 413,
                        "request_too_large")

    def chunks():                        # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 4096
        yield b'", "max_tokens": 1}'

    r = httpx.post(server.base_url + "/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413, "request_too_large")
    still_serves(server.url)
