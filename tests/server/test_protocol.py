"""Request bodies -> SamplingParams: model defaults fill only what a request leaves out."""

from __future__ import annotations

import pydantic
import pytest

from kdaserve.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def test_defaults_fill_omitted_fields():
    sp = CompletionRequest(prompt="a").sampling_params(16, None, DEFAULTS)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert (sp.max_tokens, sp.n, sp.logprobs, sp.min_p) == (16, 1, None, 0.0)


def test_request_fields_beat_defaults():
    req = CompletionRequest(prompt="a", temperature=0.0, top_k=-1, stop="x", seed=5, n=2)
    sp = req.sampling_params(4, 2, DEFAULTS)
    assert (sp.temperature, sp.top_k, sp.top_p) == (0.0, 0, 0.9)
    assert (sp.stop, sp.seed, sp.n, sp.logprobs, sp.max_tokens) == (["x"], 5, 2, 2, 4)


def test_without_defaults_vllm_values():
    sp = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).sampling_params(
        8, None, {})
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (1.0, 1.0, 0, 1.0)


@pytest.mark.parametrize("body", [
    {"prompt": "a", "max_tokens": "3"},          # strict: no str -> int
    {"prompt": "a", "max_tokens": 2.5},
    {"prompt": "a", "stream": "yes"},
    {"prompt": "a", "n": 129},
    {"prompt": [1, "b"]},
    {"prompt": "a", "stream_options": {"include_usage": True}},
])
def test_completion_request_rejects(body):
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate(body)


def test_chat_top_logprobs_needs_logprobs():
    with pytest.raises(pydantic.ValidationError, match="top_logprobs requires logprobs"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})


def test_tokenize_needs_exactly_one_input():
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        TokenizeRequest.model_validate({})
    assert TokenizeRequest.model_validate({"prompt": "x"}).add_special_tokens is True


NULLABLE_CHAT = ("stream", "n", "logprobs", "top_logprobs", "presence_penalty",
                 "frequency_penalty", "parallel_tool_calls", "include_reasoning", "ignore_eos",
                 "skip_special_tokens", "temperature", "top_p", "max_tokens",
                 "max_completion_tokens", "seed", "stop", "stream_options", "tools",
                 "tool_choice", "response_format", "logit_bias", "user", "metadata",
                 "min_tokens", "include_stop_str_in_output", "add_generation_prompt",
                 "return_token_ids", "chat_template_kwargs")


def test_null_is_not_set():
    """Every field OpenAI's reference makes nullable (and vLLM's extras) takes null as its
    default, the same request as one that leaves it out."""
    base = {"messages": [{"role": "user", "content": "hi"}]}
    want = ChatCompletionRequest.model_validate(base)
    got = ChatCompletionRequest.model_validate({**base, **dict.fromkeys(NULLABLE_CHAT)})
    assert got == want
    assert got.sampling_params(8, None, {}) == want.sampling_params(8, None, {})
    assert CompletionRequest.model_validate(
        {"prompt": "a", "echo": None, "n": None, "logprobs": None, "stream": None}) == \
        CompletionRequest(prompt="a")
    with pytest.raises(pydantic.ValidationError):     # a required field is still required
        ChatCompletionRequest.model_validate({"messages": None})


def test_strict_schemas_and_who_decides():
    """A json_schema's own `strict` wins; otherwise the server's default (strict unless
    `--open-json-objects`); tool parameters follow the function's `strict` the same way."""
    import argparse

    from kdaserve.server.args import add_serve_arguments
    from kdaserve.server.chat_plan import plan_chat

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    base = {"messages": [{"role": "user", "content": "hi"}]}

    def rf(strict):
        js = {"name": "x", "schema": schema, **({} if strict is None else {"strict": strict})}
        return ChatCompletionRequest.model_validate(
            {**base, "response_format": {"type": "json_schema", "json_schema": js}})

    assert rf(None).guided_decoding().strict is True
    assert rf(None).guided_decoding(strict=False).strict is False
    assert rf(True).guided_decoding(strict=False).strict is True
    assert rf(False).guided_decoding().strict is False

    def tools(strict):
        fn = {"name": "f", "parameters": schema, **({} if strict is None else {"strict": strict})}
        return ChatCompletionRequest.model_validate(
            {**base, "tools": [{"type": "function", "function": fn}], "tool_choice": "required"})

    closed = '"additionalProperties": false'
    assert closed in plan_chat(tools(None), None, None).guided.spec
    assert closed not in plan_chat(tools(None), None, None, strict=False).guided.spec
    assert closed in plan_chat(tools(True), None, None, strict=False).guided.spec
    assert closed not in plan_chat(tools(False), None, None).guided.spec
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args(["--open-json-objects"]).open_json_objects is True
    assert p.parse_args([]).open_json_objects is False
