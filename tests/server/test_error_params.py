"""A 400's `param` comes from the error's `param` field, not from the wording of its message."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from kdaserve.assets import DEMO_MODEL_DIR
from kdaserve.request import MAX_STOP_STRINGS, RequestError, SamplingParams
from kdaserve.server.app import build_app
from kdaserve.server.chat_plan import plan_chat
from kdaserve.server.errors import bad_request
from kdaserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kdaserve.tokenizer import Tokenizer

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize("kwargs,param", [
    ({"top_p": 0.0}, "top_p"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
])
def test_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


@pytest.mark.parametrize("body,param", [
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
])
def test_protocol_errors_name_the_field(body, param):
    req = CompletionRequest(prompt="a", **body)
    with pytest.raises(RequestError) as info:
        req.sampling_params(4, None, {}, req.guided_decoding())
    assert info.value.param == param


def test_chat_plan_errors_name_the_field():
    req = ChatCompletionRequest.model_validate({**CHAT, "tool_choice": "required"})
    with pytest.raises(RequestError) as info:
        plan_chat(req, None, None)
    assert info.value.param == "tool_choice"


def test_bad_request_reads_the_attribute_not_the_message():
    assert bad_request(RequestError("the first word is not the field", "stop")).param == "stop"
    assert bad_request(ValueError("stop words everywhere")).param is None


@pytest.fixture(scope="module")
def http():
    engine = SimpleNamespace(info=None)       # every request below is refused before the engine
    app = build_app(engine, Tokenizer.from_pretrained(DEMO_MODEL_DIR), "demo", 512)
    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "guided_json": {}, "guided_choice": ["a"]},
     "guided_json"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "3"}, "max_tokens"),      # pydantic
    ("/v1/completions", {"prompt": "a", "model": "other"}, "model"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0.0}, "top_p"),
])
def test_http_400_carries_the_param(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
