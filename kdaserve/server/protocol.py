"""OpenAI-shaped request bodies (pydantic v2); the response bodies are protocol_responses.py.

Requests are validated strictly (no "5" for 5, no true for 1): a wrong type is a 400, not a
guess. Unknown fields are ignored, as OpenAI clients send extras. `null` means "not set" for
every field (OpenAI's reference makes nearly all of them nullable, and frameworks send nulls for
what they leave alone). Fields beyond OpenAI's (top_k, min_p, repetition_penalty, ignore_eos,
...) follow vLLM's names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kdaserve.disagg.field import parse_kv_transfer
from kdaserve.request import SamplingParams, SamplingParamsError
from kdaserve.structured.spec import GuidedDecoding, GuidedDecodingError


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        # a required field sent as null is then "missing", still a 400
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


# ---- requests ----------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Request):
    """What completions and chat completions share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False       # add each choice's generated token ids (as vLLM)
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, Any] | None = None          # accepted and ignored (as OpenAI stores it)
    # structured outputs: OpenAI's response_format, and vLLM's guided_* extras
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None                # Lark (llguidance's dialect)
    prompt_logprobs: int | None = None               # vLLM's extra: the prompt's logprobs
    # disaggregation (kdaserve/disagg/params.py): set by `kdaserve proxy`, as vLLM's field
    kv_transfer_params: dict[str, Any] | None = None

    def _guided_fields(self) -> list[str]:
        asked = [name for name in ("guided_json", "guided_regex", "guided_choice",
                                   "guided_grammar") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            asked.append("response_format")
        return asked

    def guided_field(self) -> str | None:
        """The request field that carries its structured-output spec."""
        asked = self._guided_fields()
        return asked[0] if asked else None

    def guided_decoding(self, strict: bool = True) -> GuidedDecoding | None:
        """The structured-output spec the request asks for; SamplingParamsError naming the
        field. `strict`: the server's default for JSON schemas (a json_schema's own `strict`
        wins)."""
        asked = self._guided_fields()
        rf = self.response_format
        if len(asked) > 1:
            raise SamplingParamsError(f"{asked[0]} cannot be combined with {asked[1]}: give one "
                                      "structured-output constraint", asked[0])
        if not asked:
            return None
        name = asked[0]
        try:
            if name == "response_format":
                if rf.type == "json_object":
                    return GuidedDecoding("json_object")
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise GuidedDecodingError("json_schema needs a 'schema'")
                own = rf.json_schema.strict
                return GuidedDecoding("json", json.dumps(rf.json_schema.schema_),
                                      strict=strict if own is None else own)
            if name == "guided_json":
                spec = self.guided_json
                return GuidedDecoding("json", spec if isinstance(spec, str) else json.dumps(spec),
                                      strict=strict)
            if name == "guided_regex":
                return GuidedDecoding("regex", self.guided_regex)
            if name == "guided_choice":
                return GuidedDecoding("choice", choices=list(self.guided_choice))
            return GuidedDecoding("lark", self.guided_grammar)
        except (GuidedDecodingError, RecursionError) as exc:   # json.dumps of a deep object
            raise SamplingParamsError(f"{name}: {exc}", name) from None

    def logit_bias_ids(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise SamplingParamsError("logit_bias keys must be token ids (integers as "
                                      "strings)", "logit_bias") from None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: Mapping[str, Any], guided: GuidedDecoding | None = None,
                        ) -> SamplingParams:
        """Raises SamplingParamsError (a ValueError) whose `param` is the bad field."""

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0), logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            guided=guided, logit_bias=self.logit_bias_ids(),
            prompt_logprobs=self.prompt_logprobs,
            kv_transfer=parse_kv_transfer(self.kv_transfer_params),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptInput
    logprobs: int | None = None
    echo: bool = False
    return_tokens_as_token_ids: bool = False   # logprob tokens as "token_id:N" (as vLLM)


class FunctionDef(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None   # e.g. {"thinking": false}
    include_reasoning: bool = True       # false: drop reasoning_content (vLLM's name)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    return_tokens_as_token_ids: bool = False

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
