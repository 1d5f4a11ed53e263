"""Strict JSON schemas (kdaserve/structured/strict.py): which objects are closed, and what the
compiled grammar then accepts, checked with llguidance against the demo tokenizer."""

from __future__ import annotations

import json

import llguidance as llg
import pytest

from kdaserve.assets import KIMI_LINEAR_DEMO_DIR
from kdaserve.structured.compiler import grammar_text
from kdaserve.structured.spec import GuidedDecoding
from kdaserve.structured.strict import NO_ARGUMENTS, close_objects, tool_parameters
from kdaserve.structured.tokenizer import build_lltokenizer
from kdaserve.tokenizer import Tokenizer

ITEM = {"type": "object", "properties": {"n": {"type": "integer"}}}
OPEN = {"type": "object", "properties": {
    "who": {"enum": ["Hamlet", "Ophelia"]},
    "items": {"type": "array", "items": ITEM},
    "ref": {"$ref": "#/$defs/Line"},
    "any": {"anyOf": [ITEM, {"type": "string"}]}},
    "required": ["who"], "$defs": {"Line": {"properties": {"text": {"type": "string"}}}}}


def test_every_declared_object_is_closed_and_nothing_else_changes():
    got = close_objects(OPEN)
    assert got["additionalProperties"] is False
    assert got["properties"]["items"]["items"]["additionalProperties"] is False
    assert got["$defs"]["Line"]["additionalProperties"] is False
    assert got["properties"]["any"]["anyOf"][0]["additionalProperties"] is False
    assert got["properties"]["any"]["anyOf"][1] == {"type": "string"}
    assert "additionalProperties" not in got["properties"]["who"]
    assert OPEN.get("additionalProperties") is None       # the input is not modified
    strip = json.loads(json.dumps(got).replace(', "additionalProperties": false', ""))
    assert strip == OPEN


@pytest.mark.parametrize("schema", [
    {"type": "object", "additionalProperties": True},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
])
def test_objects_that_say_what_else_they_take_are_left_alone(schema):
    assert close_objects(schema) == schema


def test_all_of_members_stay_open():
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert close_objects(schema) == schema


def test_tool_parameters():
    assert tool_parameters(None, True) == NO_ARGUMENTS == tool_parameters({}, True)
    assert tool_parameters({}, False) == {"type": "object"}
    assert tool_parameters({"properties": {"a": {}}}, True) == {
        "type": "object", "properties": {"a": {}}, "additionalProperties": False}
    assert tool_parameters(OPEN, False) is OPEN


@pytest.fixture(scope="module")
def lltok():
    return build_lltokenizer(Tokenizer.from_pretrained(KIMI_LINEAR_DEMO_DIR))


def accepts(lltok, g: GuidedDecoding, text: str) -> bool:
    m = llg.LLMatcher(lltok, grammar_text(g), log_level=0)
    tokens = lltok.tokenize_str(text)
    return m.validate_tokens(tokens) == len(tokens) and m.consume_tokens(tokens) and \
        m.is_accepting()


@pytest.mark.parametrize("text,strict,open_", [
    ('{"who": "Hamlet"}', True, True),
    ('{"who": "Hamlet", "x": 1}', False, True),
    ('{"who": "Hamlet", "items": [{"n": 1, "m": 2}]}', False, True),
    ('{"who": "Hamlet", "ref": {"text": "a", "more": 1}}', False, True),
])
def test_the_compiled_grammar_refuses_undeclared_keys_unless_open(lltok, text, strict, open_):
    spec = json.dumps(OPEN)
    assert accepts(lltok, GuidedDecoding("json", spec), text) is strict
    assert accepts(lltok, GuidedDecoding("json", spec, strict=False), text) is open_


@pytest.mark.parametrize("text,ok", [("{}", True), ('{"a": 1}', False), ("false", False),
                                     ("1", False)])
def test_no_parameters_means_exactly_empty_object(lltok, text, ok):
    g = GuidedDecoding("json", json.dumps(tool_parameters(None, True)))
    assert accepts(lltok, g, text) is ok
