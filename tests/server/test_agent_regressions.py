"""Issue 31's seven defects, each at the HTTP level on the bundled demo with sampling on
(temperature 0.8, several seeds), each followed by a normal request: what agent frameworks
send by default works (tests/server/test_agent_frameworks.py drives the frameworks)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

MODEL = "kdaserve-demo"
SEEDS = (0, 1, 2)
MESSAGES = [{"role": "user", "content": "Whom shall I summon?"}]
# as LangChain, instructor and litellm send it: no additionalProperties
SUMMON = {"type": "object", "properties": {"who": {"enum": ["Hamlet", "Ophelia"]}},
          "required": ["who"]}
TOOLS = [{"type": "function", "function": {"name": "summon", "parameters": SUMMON}},
         {"type": "function", "function": {"name": "get_time"}}]
NAMED = {"type": "function", "function": {"name": "summon"}}
CLOSED = {**SUMMON, "additionalProperties": False}


@pytest.fixture(scope="module")
def http(demo_server):
    with httpx.Client(base_url=demo_server.base_url, timeout=120) as c:
        yield c


def chat(http: httpx.Client, **body) -> dict:
    r = http.post("/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                             "temperature": 0.8, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(http: httpx.Client, **body) -> list[dict]:
    with http.stream("POST", "/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "temperature": 0.8, "stream": True,
            **body}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture
def then_normal(http):
    """After each case, a plain request is answered as usual."""
    yield
    r = chat(http, max_tokens=8, temperature=0.0)
    assert r["choices"][0]["message"]["content"] and r["choices"][0]["finish_reason"] == "length"


def calls_of(r: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in r["choices"][0]["message"]["tool_calls"]]


# 1 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_open_schemas_are_strict_by_default(http, then_normal, seed):
    r = chat(http, tools=TOOLS, tool_choice=NAMED, max_tokens=60, seed=seed)
    [(name, args)] = calls_of(r)
    jsonschema.validate(args, CLOSED)
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SUMMON}}
    r = chat(http, response_format=rf, max_tokens=40, seed=seed)
    assert r["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), CLOSED)


def test_strict_false_restores_open_objects(http, then_normal):
    """The same schema with "strict": false: JSON Schema's open objects, where this model
    invents keys (the behaviour the default now prevents)."""
    open_ = []
    for seed in SEEDS:
        rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SUMMON,
                                                     "strict": False}}
        r = chat(http, response_format=rf, max_tokens=40, seed=seed)
        text = r["choices"][0]["message"]["content"]
        open_.append(r["choices"][0]["finish_reason"] == "length" or set(json.loads(text))
                     != {"who"})
    assert any(open_)


# 2 ----------------------------------------------------------------------------------------------
def check_chunk_shape(chunks: list[dict]) -> dict[int, str]:
    """No null in a delta; a call's id, type and name once, in its first delta. Returns each
    call's arguments."""
    args: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            assert None not in delta.values()
            for tc in delta.get("tool_calls", []):
                assert None not in tc.values() and None not in tc["function"].values()
                if tc["index"] in args:
                    assert not {"id", "type"} & set(tc) and "name" not in tc["function"]
                else:
                    assert tc["type"] == "function" and tc["id"] and tc["function"]["name"]
                    args[tc["index"]] = ""
                args[tc["index"]] += tc["function"].get("arguments", "")
    return args


@pytest.mark.parametrize("seed", SEEDS)
def test_stream_chunks_leave_unset_fields_out(http, then_normal, seed):
    forced = check_chunk_shape(stream_chunks(http, tools=TOOLS, tool_choice="required",
                                             max_tokens=90, seed=seed))
    assert forced
    # the model's own format (tool_choice auto): arguments stream in several deltas
    chunks = stream_chunks(http, tools=TOOLS, tool_choice="auto", max_tokens=200, seed=seed,
                           guided_grammar=k3_calls(2, typed=True))
    calls = check_chunk_shape(chunks)
    assert [json.loads(a) for a in calls.values()] == [{"who": "Hamlet"}] * 2
    pieces = sum(len(ch["delta"].get("tool_calls", [])) for c in chunks for ch in c["choices"])
    assert pieces > len(calls)
    client = openai.OpenAI(base_url=str(http.base_url), api_key="unused", max_retries=0)
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                        tool_choice="required", max_tokens=90,
                                        temperature=0.8, seed=seed) as s:
        final = s.get_final_completion()          # its helper asserted type == "function"
    assert final.choices[0].message.tool_calls


# 3 ----------------------------------------------------------------------------------------------
ANSWER = {"type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"]}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_tool_choice_with_response_format(http, then_normal, seed, choice):
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    r = chat(http, tools=TOOLS, tool_choice=choice, response_format=rf, max_tokens=90,
             seed=seed)
    calls = calls_of(r)
    assert calls and all(n in ("summon", "get_time") for n, _ in calls)
    msg = r["choices"][0]["message"]
    follow = MESSAGES + [msg] + [{"role": "tool", "tool_call_id": c["id"], "content": "done"}
                                 for c in msg["tool_calls"]]
    r2 = http.post("/chat/completions", json={
        "model": MODEL, "messages": follow, "tools": TOOLS, "response_format": rf,
        "max_tokens": 30, "temperature": 0.8, "seed": seed}).json()
    jsonschema.validate(json.loads(r2["choices"][0]["message"]["content"]),
                        {**ANSWER, "additionalProperties": False})


# 4 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_forced_calls_cut_by_max_tokens(http, then_normal, seed):
    # cut inside the first call: no call, and none of its text in content
    r = chat(http, tools=TOOLS, tool_choice=NAMED, max_tokens=20, seed=seed)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"] == [] and "[" not in (choice["message"]["content"]
                                                                 or "")
    # the default parallel_tool_calls: the list ends while the budget can close it
    for max_tokens in (60, 120):
        r = chat(http, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, seed=seed)
        assert r["choices"][0]["finish_reason"] == "tool_calls"
        assert calls_of(r) and not r["choices"][0]["message"]["content"]
    # streamed and cut: every call sent parses, and content holds none of the raw text
    for max_tokens in (20, 45):
        calls: dict[int, str] = {}
        content = ""
        for chunk in stream_chunks(http, tools=TOOLS, tool_choice="required",
                                   max_tokens=max_tokens, seed=seed):
            for ch in chunk["choices"]:
                content += ch["delta"].get("content", "")
                for tc in ch["delta"].get("tool_calls", []):
                    calls[tc["index"]] = calls.get(tc["index"], "") + \
                        tc["function"].get("arguments", "")
        assert "[" not in content
        for arguments in calls.values():
            assert isinstance(json.loads(arguments), dict)


# 5 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("params", [None, {}, {"type": "object"}])
def test_functions_without_parameters_take_exactly_empty_object(http, then_normal, seed, params):
    fn = {"name": "get_time", **({} if params is None else {"parameters": params})}
    r = chat(http, tools=[{"type": "function", "function": fn}],
             tool_choice={"type": "function", "function": {"name": "get_time"}},
             max_tokens=40, seed=seed)
    assert calls_of(r) == [("get_time", {})]
    assert r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == "{}"


# 6 ----------------------------------------------------------------------------------------------
NULLS = dict.fromkeys(("stream", "n", "logprobs", "top_logprobs", "presence_penalty",
                       "frequency_penalty", "parallel_tool_calls", "include_reasoning",
                       "ignore_eos", "skip_special_tokens", "stop", "seed", "user",
                       "stream_options", "response_format", "logit_bias"))


@pytest.mark.parametrize("seed", SEEDS)
def test_null_means_not_set(http, then_normal, seed):
    r = chat(http, max_tokens=6, **{**NULLS, "seed": seed})
    assert r["choices"][0]["message"]["content"]
    r = http.post("/completions", json={"model": MODEL, "prompt": "ROMEO:", "max_tokens": 4,
                                        "temperature": 0.8, "seed": seed, "echo": None,
                                        **NULLS})
    assert r.status_code == 200, r.text


# 7 ----------------------------------------------------------------------------------------------
def k3_calls(n: int, typed: bool = False) -> str:
    """A Lark grammar forcing n calls in K3's own format (what tool_choice auto parses)."""
    call = ('<|open|>call tool="get_time" index="{i}"<|sep|><|open|>json type="object"<|sep|>'
            '{{}}<|close|>json<|sep|><|close|>call<|sep|>')
    if typed:
        call = ('<|open|>call tool="summon" index="{i}"<|sep|><|open|>argument key="who" '
                'type="string"<|sep|>Hamlet<|close|>argument<|sep|><|close|>call<|sep|>')
    text = "<|open|>tools<|sep|>" + "".join(call.format(i=i + 1) for i in range(n)) + \
        "<|close|>tools<|sep|>"
    return "start: " + json.dumps(text)


@pytest.mark.parametrize("seed", SEEDS)
def test_parallel_tool_calls_false_with_auto(http, then_normal, seed):
    body = {"tools": TOOLS, "tool_choice": "auto", "guided_grammar": k3_calls(2),
            "max_tokens": 200, "seed": seed}
    assert len(calls_of(chat(http, **body))) == 2
    r = chat(http, parallel_tool_calls=False, **body)
    assert calls_of(r) == [("get_time", {})]
    chunks = stream_chunks(http, parallel_tool_calls=False, **body)
    indexes = {tc["index"] for c in chunks for ch in c["choices"]
               for tc in ch["delta"].get("tool_calls", [])}
    assert indexes == {0}


def test_assistant_message_with_null_content_and_no_calls(http, then_normal):
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": []},
                           {"role": "user", "content": "Well?"}]
    r = http.post("/chat/completions", json={"model": MODEL, "messages": messages,
                                             "max_tokens": 6, "temperature": 0.8, "seed": 1})
    assert r.status_code == 200, r.text
