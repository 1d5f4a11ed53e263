"""Structured outputs over HTTP with the `openai` client and the bundled demo model:
response_format json_schema with 50 different schemas and sampling on, json_object, the
guided_* extras, logit_bias, and the 400s for what the engine cannot compile."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from server_harness import assert_openai_error

MODEL = "kdaserve-demo"
MESSAGES = [{"role": "user", "content": "Tell me of the king."}]


@pytest.fixture(scope="module")
def client(demo_server):
    with openai.OpenAI(base_url=demo_server.base_url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects, enums, arrays and numbers with ranges; strings short so small models end."""
    kinds = ["string", "integer", "number", "enum", "boolean"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        lo = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + 5, 2)}
    if kind == "enum":
        return {"enum": rng.sample(["king", "queen", "fool", "ghost", 1, 2.5, None, True], 3)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": 1, "maxItems": rng.randint(1, 3)}
    names = rng.sample(["name", "age", "title", "lines", "score", "crown", "realm"],
                       rng.randint(1, 3))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": names, "additionalProperties": False}


def test_json_schema_50_schemas(client):
    rng = random.Random(0)
    schemas = [{"type": "object", "properties": {"answer": random_schema(rng)},
                "required": ["answer"], "additionalProperties": False} for _ in range(50)]

    def ask(i: int) -> tuple[dict, str]:
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=300, temperature=1.0, seed=i,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schemas[i]}})
        return schemas[i], r.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(50)))
    for schema, text in results:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_guided_extras(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100,
                                       temperature=0.7, seed=1,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":      # free-form keys may run to max_tokens
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                       extra_body={"guided_choice": ["aye", "nay"]})
    assert r.choices[0].message.content in ("aye", "nay")
    r = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=20,
                                  extra_body={"guided_regex": "[A-Z][a-z]{1,8} [0-9]{3}"})
    text = r.choices[0].text
    assert text[0].isupper() and text[-3:].isdigit() and len(text.split()) == 2


def test_streamed_json_schema(client):
    schema = {"type": "object", "properties": {"who": {"enum": ["Romeo", "Juliet"]},
                                               "n": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
              "required": ["who", "n"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_logit_bias(client):
    base = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=1,
                                     temperature=0.0, extra_body={"return_token_ids": True})
    first = base.choices[0].model_extra["token_ids"][0]
    biased = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=1,
                                       temperature=0.0, logit_bias={str(first): -100},
                                       extra_body={"return_token_ids": True})
    assert biased.choices[0].model_extra["token_ids"][0] != first


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
])
def test_bad_specs_are_400(demo_server, body, param):
    r = httpx.post(demo_server.base_url + "/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 5, **body})
    err = assert_openai_error(r, 400)
    assert err["param"] == param, err
