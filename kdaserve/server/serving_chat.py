"""/v1/chat/completions: messages (with images, tools, reasoning) rendered through the chat
template, the answer parsed back into content, reasoning and tool calls, whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kdaserve.image_io import ImageError, check_count
from kdaserve.server.chat_output import ChatDelta, ChatOutput
from kdaserve.server.chat_plan import ChatPlan, plan_chat
from kdaserve.server.errors import APIError, bad_request
from kdaserve.server.guards import check_sequences
from kdaserve.server.protocol import ChatCompletionRequest
from kdaserve.server.protocol_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from kdaserve.server.runs import DONE, Prompt, Run, json_response, sse, unless_disconnected
from kdaserve.server.serving import ServingBase
from kdaserve.vision_input import split_chat_images


class ChatServing(ServingBase):
    async def _chat_images(self, messages: list[dict[str, Any]], request: Request
                           ) -> tuple[list[dict[str, Any]], list[Any]]:
        """image_url parts -> the model's image marker in the text, and the decoded images
        (each refusal a 400 that names the limit; kdaserve/server/image_decoding.py)."""
        try:
            messages, refs = split_chat_images(
                messages, self.vision.marker if self.vision is not None else None)
            if not refs:
                return messages, []
            check_count(len(refs), self.image_limits)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        tokens_of = self.vision.num_tokens if self.vision is not None else None
        try:
            images = await unless_disconnected(
                request, self.images.load(refs, tokens_of, self.max_model_len - 1))
        except ImageError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_image") from None
        return messages, images

    def _chat_logprobs(self, token_ids: list[int], lps: list[dict[int, float]], k: int,
                       as_ids: bool) -> list[ChatTokenLogprob]:
        def entry(tid: int, lp: float) -> dict[str, Any]:
            text = self.token_text(tid, as_ids)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

        out = []
        for tid, lp in zip(token_ids, lps):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            out.append(ChatTokenLogprob(**entry(tid, lp[tid]),
                                        top_logprobs=[TopLogprob(**entry(t, v)) for t, v in top]))
        return out

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        check_sequences(1, req.n, self.limits)
        try:
            plan = plan_chat(req, self.tool_call_parser, self.reasoning_parser,
                             self.strict_schemas)
        except ValueError as exc:
            raise bad_request(exc) from None
        messages, images = await self._chat_images(self.user_messages(req.messages), request)
        text = await self.render_chat(messages, req.add_generation_prompt,
                                      **plan.template_kwargs)
        prompt = Prompt(await self.encode(text, "messages", add_special_tokens=False,
                                          rendered=True), text)
        if images:
            try:
                ids, media = await self._off_loop(self.vision.expand, prompt.token_ids, images)
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
            prompt = Prompt(ids, text, media)
        if not prompt.token_ids:
            raise APIError(400, "the rendered messages have no tokens", param="messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if requested is None:       # the default, or what fits if less
            self._check_fits(len(prompt.token_ids), 1, "messages")
            room = self.max_model_len - len(prompt.token_ids)
            requested = min(self.defaults.get("max_tokens", self.limits.default_max_tokens),
                            room)
        k = (req.top_logprobs or 0) if req.logprobs else None
        self._check_prompt_logprobs(req)
        params = self._params(req, requested, k, plan)
        self._check_fits(len(prompt.token_ids), requested, "messages")
        if (held := await self._answer_hold([prompt], params)) is not None:
            return held
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        runs = await self._start(request, request_id, [prompt], params, bool(req.stream))
        if req.stream:
            return self._stream(self._chat_events(req, request_id, runs[0], plan))
        [outs] = await self._collect(request, runs)
        choices = []
        for j, c in enumerate(outs):
            reasoning, content, calls = plan.output(text, self.specials, eager=False).whole(
                c.text)
            message = ChatMessage(
                content=content if content or not calls else None,
                reasoning_content=reasoning if reasoning and plan.include_reasoning else None,
                tool_calls=[ToolCallOut(id=tc.id, function=FunctionCall(
                    name=tc.name, arguments=tc.arguments)) for tc in calls])
            choices.append(ChatChoice(
                index=j, message=message,
                logprobs=ChatLogprobs(content=self._chat_logprobs(
                    c.token_ids, c.logprobs, k, req.return_tokens_as_token_ids))
                if k is not None else None,
                finish_reason=plan.finish_reason(c.finish_reason, len(calls)),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if req.return_token_ids else None))
        usage = UsageInfo.of(len(prompt.token_ids), sum(len(c.token_ids) for c in outs))
        return json_response(ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage,
            prompt_logprobs=self._prompt_logprobs(req, prompt, outs[0].prompt_logprobs)))

    def _chat_delta(self, plan: ChatPlan, out: ChatOutput, text: str,
                    final: bool) -> DeltaMessage | None:
        d = out.feed(text) if text else None
        if final:
            last = out.finish()
            d = last if d is None else ChatDelta(d.reasoning + last.reasoning,
                                                 d.content + last.content, d.calls + last.calls)
        if d is None or not d:
            return None
        calls: list[DeltaToolCall] = []
        for c in d.calls:            # one entry per call in a chunk, as OpenAI sends them
            if calls and calls[-1].index == c.index and c.id is None:
                f = calls[-1].function
                f.arguments = (f.arguments or "") + c.arguments
                continue
            calls.append(DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                                       function=DeltaFunctionCall(name=c.name,
                                                                  arguments=c.arguments)))
        reasoning = d.reasoning if plan.include_reasoning else ""
        if not (d.content or reasoning or calls):
            return None
        return DeltaMessage(content=d.content or None, reasoning_content=reasoning or None,
                            tool_calls=calls or None)

    async def _chat_events(self, req: ChatCompletionRequest, request_id: str,
                           run: Run, plan: ChatPlan) -> AsyncIterator[str]:
        created = int(time.time())
        k = (req.top_logprobs or 0) if req.logprobs else None
        generated = 0
        outputs = [plan.output(run.prompt.text or "", self.specials, eager=True)
                   for _ in range(run.n)]

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created,
                                            model=self.model_name, choices=choices, usage=usage))

        try:
            for j in range(run.n):
                yield chunk([ChatStreamChoice(index=j,
                                              delta=DeltaMessage(role="assistant", content=""))])
            while (d := await run.next()) is not None:
                generated += len(d.new_token_ids)
                lp = None
                if k is not None and d.new_token_ids:
                    lp = ChatLogprobs(content=self._chat_logprobs(
                        d.new_token_ids, d.new_logprobs or [], k, req.return_tokens_as_token_ids))
                out = outputs[d.index]
                delta = self._chat_delta(plan, out, d.new_text, d.finished)
                if not (delta or d.finished or lp):
                    continue
                yield chunk([ChatStreamChoice(
                    index=d.index, delta=delta or DeltaMessage(), logprobs=lp,
                    finish_reason=plan.finish_reason(d.finish_reason, out.num_calls)
                    if d.finished else None,
                    stop_reason=d.stop_reason if d.finished else None,
                    token_ids=d.new_token_ids if req.return_token_ids else None)])
            if req.include_usage:
                yield chunk([], UsageInfo.of(len(run.prompt.token_ids), generated))
        except Exception as exc:
            yield self._error_event(exc)
        finally:
            await self._close([run])
        yield DONE
