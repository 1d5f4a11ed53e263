"""Tool calling over HTTP with the `openai` client and the bundled demo model (a model that
never saw tools): a named tool_choice and "required" are enforced by constrained decoding, so
the calls' arguments validate against the functions' schemas, streamed and not; tool results
come back as role "tool" messages; the K3 parsers run on its output without harm."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_harness import assert_openai_error

MODEL = "kdaserve-demo"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days", "unit"], "additionalProperties": False}
SUMMON = {"type": "object", "properties": {"who": {"enum": ["Hamlet", "Ophelia"]}},
          "required": ["who"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city"}},
         {"type": "function", "function": {"name": "summon", "parameters": SUMMON}}]
SCHEMAS = {"get_weather": WEATHER, "summon": SUMMON}
MESSAGES = [{"role": "user", "content": "What weather in Verona?"}]


@pytest.fixture(scope="module")
def client(demo_server):
    with openai.OpenAI(base_url=demo_server.base_url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def check_call(name: str, arguments: str, want: str | None = None) -> None:
    assert name in SCHEMAS and (want is None or name == want)
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_tool_choice(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0.8, seed=2,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = r.choices[0].message
    assert len(msg.tool_calls) == 1 and msg.content is None
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments, "get_weather")
    assert r.choices[0].finish_reason == "stop"       # as OpenAI for a named function


def test_named_tool_choice_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0.8, seed=4,
        stream=True, tool_choice={"type": "function", "function": {"name": "summon"}})
    calls: dict[int, dict] = {}
    pieces = 0
    for chunk in stream:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name,
                                                "arguments": ""})
            entry["arguments"] += tc.function.arguments or ""
            pieces += 1
    assert list(calls) == [0] and calls[0]["id"]
    check_call(calls[0]["name"], calls[0]["arguments"], "summon")
    # a forced call is sent once its arguments have closed (max_tokens could cut it): whole
    assert pieces == 1


def test_required_and_tool_results(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       max_tokens=200, temperature=0.0, tool_choice="required",
                                       parallel_tool_calls=False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    check_call(call.function.name, call.function.arguments)
    follow = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "grey"}'}]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS,
                                        max_tokens=8, temperature=0.0)
    assert r2.choices[0].message.tool_calls == [] and r2.choices[0].message.content


def test_auto_with_parsers_is_plain_text_for_this_model(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       max_tokens=12, temperature=0.0, stop=["\n\n"])
    assert r.choices[0].message.tool_calls == [] and r.choices[0].message.content
    assert r.choices[0].message.reasoning_content is None
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                           temperature=0.0, stop=["\n\n"])
    # the demo template ignores tools: the same prompt, so the same greedy text
    assert plain.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),                        # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400(demo_server, body, param):
    r = httpx.post(demo_server.base_url + "/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert assert_openai_error(r, 400)["param"] == param
