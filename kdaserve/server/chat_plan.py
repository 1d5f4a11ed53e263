"""What a chat request's tools, tool_choice, structured-output fields and thinking switch
mean for one generation: the template's arguments, the grammar, and how the output is parsed.

- tools + tool_choice "auto" (the default with tools): tools go to the chat template and the
  server's `--tool-call-parser` reads calls from the model's own format; no parser is a 400.
- "required" or a named function: constrained decoding forces `json_calls`' format, so even a
  model that never saw tools emits a valid call whose arguments match the schema. A
  response_format in the same request is for the final answer, in a later turn (as OpenAI):
  this turn's grammar is the calls'.
- `parallel_tool_calls: false` keeps one call, whatever the tool_choice.
- JSON schemas (tool parameters, response formats) are strict unless the request or server
  says otherwise (kdaserve/structured/strict.py).
- "none" (or no tools): no tools in the prompt, no parsing.
- A grammar (response_format, guided_*, forced calls) applies from the first token, so thinking
  is switched off in the template unless the request set it (the model cannot think inside a
  grammar).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kdaserve.request import RequestError
from kdaserve.server.chat_output import ChatOutput
from kdaserve.server.protocol import ChatCompletionRequest, NamedToolChoice
from kdaserve.server.reasoning import (
    REASONING_FORMATS,
    THINKING_KWARGS,
    ReasoningFormat,
    ReasoningParser,
)
from kdaserve.server.tool_parsers import TOOL_PARSERS, JsonCallsParser, ToolParser, call_grammar
from kdaserve.server.tool_parsers.json_calls import NAME_RE
from kdaserve.structured.spec import GuidedDecoding
from kdaserve.structured.strict import tool_parameters

MAX_TOOL_SCHEMA_CHARS = 65_536


@dataclass
class ChatPlan:
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    guided: GuidedDecoding | None = None
    tool_parser: type[ToolParser] | None = None
    forced_name: str | None = None           # a named tool_choice
    reasoning: ReasoningFormat | None = None
    include_reasoning: bool = True
    max_calls: int | None = None             # 1 when parallel_tool_calls is false

    @property
    def forced_calls(self) -> bool:
        return self.tool_parser is JsonCallsParser

    @property
    def keeps_special_tokens(self) -> bool:
        """Parsers read markers that are special tokens: the detokenizer must keep them."""
        return self.reasoning is not None or (self.tool_parser is not None
                                              and self.tool_parser is not JsonCallsParser)

    def output(self, prompt_text: str, specials: list[str], eager: bool) -> ChatOutput:
        reasoning = ReasoningParser(self.reasoning, prompt_text) if self.reasoning else None
        tools = self.tool_parser(eager=eager) if self.tool_parser else None
        return ChatOutput(reasoning, tools, specials if self.keeps_special_tokens else (),
                          self.max_calls)

    def finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        """A call cut by max_tokens was dropped: the reason stays "length"."""
        if reason == "stop" and num_calls and self.forced_name is None:
            return "tool_calls"
        return reason


def _bad(param: str, why: str) -> RequestError:
    return RequestError(f"{param} {why}", param)


def plan_chat(req: ChatCompletionRequest, tool_parser: str | None,
              reasoning_parser: str | None, strict: bool = True) -> ChatPlan:
    """Raises RequestError (a 400) whose `param` is the field it names. `strict`: the
    server's default for JSON schemas a request does not mark strict or not."""
    plan = ChatPlan(template_kwargs=dict(req.chat_template_kwargs or {}),
                    include_reasoning=req.include_reasoning,
                    max_calls=None if req.parallel_tool_calls else 1)
    if reasoning_parser:
        plan.reasoning = REASONING_FORMATS[reasoning_parser]
    guided = req.guided_decoding(strict)
    choice = req.tool_choice
    tools = req.tools or []
    for t in tools:
        if not NAME_RE.match(t.function.name):
            raise _bad("tools", f"function names must match [A-Za-z0-9_-]{{1,64}}, got "
                       f"{t.function.name[:80]!r}")
        if len(json.dumps(t.function.parameters or {})) > MAX_TOOL_SCHEMA_CHARS:
            raise _bad("tools", f"a function's parameters schema is over "
                       f"{MAX_TOOL_SCHEMA_CHARS} characters")
    if choice is not None and choice != "none" and not tools:
        raise _bad("tool_choice", "needs tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none":
        plan.template_kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    if isinstance(choice, NamedToolChoice) or choice == "required":
        functions = [(t.function.name, tool_parameters(
            t.function.parameters, strict if t.function.strict is None else t.function.strict))
            for t in tools]
        parallel = req.parallel_tool_calls
        if isinstance(choice, NamedToolChoice):
            plan.forced_name = choice.function.name
            functions = [f for f in functions if f[0] == plan.forced_name]
            if not functions:
                raise _bad("tool_choice", f"names {plan.forced_name!r}, which is not in tools")
            parallel = False
        guided = call_grammar(functions, parallel)
        plan.tool_parser = JsonCallsParser
    elif choice == "auto":
        if tool_parser is None:
            raise _bad("tool_choice", '"auto" needs the server started with '
                       "--tool-call-parser (or use \"required\" or a named function)")
        plan.tool_parser = TOOL_PARSERS[tool_parser]
    plan.guided = guided
    if guided is not None and not any(k in plan.template_kwargs for k in THINKING_KWARGS):
        plan.template_kwargs.update({k: False for k in THINKING_KWARGS})
    return plan
