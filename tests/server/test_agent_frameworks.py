"""Agent frameworks that no one here wrote, unchanged, against a live `kdaserve serve` on the
bundled demo (issue 31): the openai SDK's stream() and parse() helpers, the OpenAI Agents
SDK, LangChain, pydantic-ai and instructor. Each case checks that the tool ran, that its
result went back to the model, and that a final answer arrived, with no exception.

The demo never saw tools and writes Shakespeare: what makes these pass is the server (strict
schemas, forced calls that close, OpenAI's chunk shape, nulls accepted). Schemas use enums and
bounded integers, as a free string is as long as the demo likes. Seeds: KDASERVE_AGENT_SEEDS
(2 in CI; the issue's goal is 20: `KDASERVE_AGENT_SEEDS=20 pytest
tests/server/test_agent_frameworks.py`). A framework that is not installed is skipped (they
are in pyproject's `test` extra; instructor is installed by .ci/run, see there).
"""

from __future__ import annotations

import os
from typing import Literal

import openai
import pydantic
import pytest

MODEL = "kdaserve-demo"
SEEDS = range(int(os.environ.get("KDASERVE_AGENT_SEEDS", "2")))
MAX_TOKENS = 90          # a call is ~45 tokens in the demo's vocabulary (JSON is near 1 char/token)
QUESTION = "What is the weather in Verona?"
RESULT = "sunny and mild"


class Answer(pydantic.BaseModel):
    """The forecast."""

    sky: Literal["sunny", "grey"]
    days: int = pydantic.Field(ge=1, le=7)


class Weather:
    """The tool (`fn`, a plain function as frameworks want it), recording its calls so that a
    test can tell that it ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []

        def get_weather(city: Literal["Verona", "Mantua"]) -> str:
            """The weather in a city."""
            self.calls.append(city)
            return RESULT

        self.fn = get_weather


@pytest.fixture(params=SEEDS)
def seed(request):
    return request.param


def sampling(seed: int) -> dict:
    return {"temperature": 0.8, "seed": seed}


# ---- the openai SDK ----------------------------------------------------------------------------
TOOL = openai.pydantic_function_tool(
    pydantic.create_model("get_weather", city=(Literal["Verona", "Mantua"], ...)),
    name="get_weather", description="The weather in a city.")


@pytest.fixture(scope="module")
def client(demo_server):
    with openai.OpenAI(base_url=demo_server.base_url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def assistant_turn(msg) -> dict:
    """The assistant's message as the next request's history (content null, as SDKs send)."""
    return {"role": "assistant", "content": msg.content, "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in msg.tool_calls]}


def run_tool_calls(tool_calls, weather: Weather) -> list[dict]:
    out = []
    for call in tool_calls:
        assert call.function.name == "get_weather"
        args = call.function.parsed_arguments
        out.append({"role": "tool", "tool_call_id": call.id,
                    "content": weather.fn(**(args.model_dump() if args else {}))})
    return out


def test_openai_stream_helper(client, seed):
    weather = Weather()
    messages = [{"role": "user", "content": QUESTION}]
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=[TOOL],
                                        tool_choice="required", max_tokens=MAX_TOKENS,
                                        **sampling(seed)) as stream:
        events = [e.type for e in stream]
        first = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    msg = first.choices[0].message
    messages += [assistant_turn(msg), *run_tool_calls(msg.tool_calls, weather)]
    assert weather.calls
    # the demo's prose runs to max_tokens, and the helper raises on "length" when tools are
    # given (as for OpenAI): a stop string ends the answer
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=[TOOL],
                                        max_tokens=24, stop=["\n"], **sampling(seed)) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content


def test_openai_parse_helper(client, seed):
    weather = Weather()
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.parse(model=MODEL, messages=messages, tools=[TOOL],
                                          tool_choice="required", response_format=Answer,
                                          max_tokens=MAX_TOKENS, **sampling(seed))
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    messages += [assistant_turn(msg), *run_tool_calls(msg.tool_calls, weather)]
    final = client.chat.completions.parse(model=MODEL, messages=messages, tools=[TOOL],
                                          response_format=Answer, max_tokens=MAX_TOKENS,
                                          **sampling(seed))
    assert weather.calls and isinstance(final.choices[0].message.parsed, Answer)


# ---- OpenAI Agents SDK ---------------------------------------------------------------------------
@pytest.mark.parametrize("output_type", [None, Answer])
def test_openai_agents(demo_server, seed, output_type):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    weather = Weather()
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=demo_server.base_url, api_key="unused", max_retries=0))
    settings = agents.ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS,
                                    temperature=0.8, extra_args={"seed": seed})
    agent = agents.Agent(name="forecaster", instructions="Answer.", model=model,
                         model_settings=settings, output_type=output_type,
                         tools=[agents.function_tool(weather.fn)])
    result = agents.Runner.run_sync(agent, QUESTION, max_turns=4)
    assert weather.calls
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert outputs and all(i.output == RESULT for i in outputs)
    # the final turn's request carried the tool's result back
    assert any(RESULT in str(item) for item in result.to_input_list())
    if output_type is None:
        assert isinstance(result.final_output, str) and result.final_output
    else:
        assert isinstance(result.final_output, Answer)


# ---- LangChain -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(demo_server):
    lc = pytest.importorskip("langchain_openai")
    return lambda seed: lc.ChatOpenAI(model=MODEL, base_url=demo_server.base_url,
                                      api_key="unused", max_tokens=MAX_TOKENS, temperature=0.8,
                                      seed=seed, max_retries=0)


@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_langchain_bind_tools(chat_model, seed, tool_choice):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool

    weather = Weather()
    get_weather = tool(weather.fn)
    llm = chat_model(seed)
    messages = [HumanMessage(QUESTION)]
    ai = llm.bind_tools([get_weather], tool_choice=tool_choice).invoke(messages)
    assert ai.tool_calls and not ai.invalid_tool_calls
    messages += [ai, *(get_weather.invoke(tc) for tc in ai.tool_calls)]
    assert messages[-1].content == RESULT and len(weather.calls) == len(ai.tool_calls)
    final = llm.bind(max_tokens=12).invoke(messages)
    assert final.content and not final.tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat_model, seed, method):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool

    weather = Weather()
    get_weather = tool(weather.fn)
    llm = chat_model(seed)
    messages = [HumanMessage(QUESTION)]
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke(messages)
    messages += [ai, *(get_weather.invoke(tc) for tc in ai.tool_calls)]
    assert weather.calls and messages[-1].content == RESULT
    answer = llm.with_structured_output(Answer, method=method).invoke(messages)
    assert isinstance(answer, Answer)


# ---- pydantic-ai ---------------------------------------------------------------------------------
def test_pydantic_ai(demo_server, seed):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.usage import UsageLimits
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    weather = Weather()
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=demo_server.base_url,
                                                           api_key="unused"))

    def settings(ctx):           # the tool on the first step, then the output tool
        return {"max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": seed,
                "tool_choice": ["get_weather" if ctx.run_step <= 1 else "final_result"]}

    agent = Agent(model, output_type=Answer, model_settings=settings, tools=[weather.fn])
    result = agent.run_sync(QUESTION, usage_limits=UsageLimits(request_limit=4))
    assert weather.calls and isinstance(result.output, Answer)
    returns = [p for m in result.all_messages() for p in m.parts
               if isinstance(p, ToolReturnPart) and p.tool_name == "get_weather"]
    assert returns and all(p.content == RESULT for p in returns)


# ---- instructor ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(demo_server, seed, mode):
    instructor = pytest.importorskip("instructor")
    weather = Weather()
    client = openai.OpenAI(base_url=demo_server.base_url, api_key="unused", max_retries=0)
    # instructor extracts and runs no tools: the tool turn goes through the openai SDK
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.parse(model=MODEL, messages=messages, tools=[TOOL],
                                          tool_choice="required", max_tokens=MAX_TOKENS,
                                          **sampling(seed))
    msg = first.choices[0].message
    messages += [assistant_turn(msg), *run_tool_calls(msg.tool_calls, weather)]
    assert weather.calls
    c = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    answer = c.chat.completions.create(model=MODEL, response_model=Answer, messages=messages,
                                       max_tokens=MAX_TOKENS, max_retries=0, **sampling(seed))
    assert isinstance(answer, Answer)
