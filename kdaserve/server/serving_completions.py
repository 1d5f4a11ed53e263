"""/v1/completions: prompts (text or token ids, one or many) in, completions out, whole or
streamed as server-sent events; echo and logprobs in OpenAI's legacy shape."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kdaserve.server.errors import APIError
from kdaserve.server.guards import check_sequences, check_token_ids
from kdaserve.server.protocol import CompletionRequest
from kdaserve.server.protocol_responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
)
from kdaserve.server.runs import DONE, Prompt, Run, json_response, merge, sse
from kdaserve.server.serving import ServingBase


class CompletionServing(ServingBase):
    async def _completion_prompts(self, prompt: Any, n: int) -> list[Prompt]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt must not be empty", param="prompt")
        check_sequences(len(items), n, self.limits)      # before tokenizing any of them
        prompts = []
        vocab = self.engine.info.vocab_size if self.engine.info else self.tokenizer.vocab_size
        for item in items:
            if isinstance(item, str):
                p = Prompt(await self.encode(item, "prompt", add_special_tokens=True), item)
            else:
                check_token_ids(item, vocab, "prompt")
                p = Prompt(list(item))
            if not p.token_ids:
                raise APIError(400, "prompt must not be empty", param="prompt")
            prompts.append(p)
        return prompts

    def _echo_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids)

    def _completion_logprobs(self, token_ids: list[int], lps: list[dict[int, float] | None],
                             offset: int, as_ids: bool, out: CompletionLogprobs | None = None,
                             ) -> tuple[CompletionLogprobs, int]:
        """Appends to `out` (a new one if None). An entry None (the prompt's first token,
        which nothing predicts) gives a None logprob, as in OpenAI's echo."""
        out = out if out is not None else CompletionLogprobs()
        for tid, entry in zip(token_ids, lps):
            text = self.token_text(tid, as_ids)
            out.tokens.append(text)
            out.token_logprobs.append(entry.get(tid) if entry is not None else None)
            out.top_logprobs.append(None if entry is None else
                                    {self.token_text(t, as_ids): lp for t, lp in entry.items()})
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset

    def _echo_logprobs(self, prompt: Prompt, lps: list[dict[int, float] | None] | None,
                       as_ids: bool) -> tuple[CompletionLogprobs, int]:
        """The prompt's tokens with their logprobs (echo with logprobs)."""
        return self._completion_logprobs(prompt.token_ids, lps or [None], 0, as_ids)

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        prompts = await self._completion_prompts(req.prompt, req.n)
        max_tokens = req.max_tokens if req.max_tokens is not None else self.defaults.get(
            "max_tokens", 16)
        self._check_prompt_logprobs(req)
        params = self._params(req, max_tokens, req.logprobs)
        echo_lps = req.echo and req.logprobs is not None
        if echo_lps:          # the prompt's logits are computed for this request only
            params.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
        for p in prompts:
            self._check_fits(len(p.token_ids), max_tokens, "prompt")
        if (held := await self._answer_hold(prompts, params)) is not None:
            return held
        request_id = f"cmpl-{uuid.uuid4().hex}"
        runs = await self._start(request, request_id, prompts, params, bool(req.stream))
        if req.stream:
            return self._stream(self._completion_events(req, request_id, runs))
        results = await self._collect(request, runs)
        choices = []
        for i, (run, outs) in enumerate(zip(runs, results)):
            prefix = self._echo_text(run.prompt) if req.echo else ""
            for j, c in enumerate(outs):
                lp = None
                if req.logprobs is not None:
                    as_ids = req.return_tokens_as_token_ids
                    head, _ = self._echo_logprobs(run.prompt, c.prompt_logprobs, as_ids) \
                        if echo_lps else (None, 0)
                    lp, _ = self._completion_logprobs(c.token_ids, c.logprobs, len(prefix),
                                                      as_ids, head)
                choices.append(CompletionChoice(
                    index=i * run.n + j, text=prefix + c.text, logprobs=lp,
                    prompt_logprobs=self._prompt_logprobs(req, run.prompt, c.prompt_logprobs),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    token_ids=c.token_ids if req.return_token_ids else None))
        usage = UsageInfo.of(sum(len(r.prompt.token_ids) for r in runs),
                             sum(len(c.token_ids) for outs in results for c in outs))
        return json_response(CompletionResponse(id=request_id, model=self.model_name,
                                                choices=choices, usage=usage))

    async def _completion_events(self, req: CompletionRequest, request_id: str,
                                 runs: list[Run]) -> AsyncIterator[str]:
        created = int(time.time())
        n = runs[0].n
        offsets = [0] * (len(runs) * n)
        generated = 0

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse(CompletionChunk(id=request_id, created=created, model=self.model_name,
                                        choices=choices, usage=usage))

        deltas = merge(runs)
        # with logprobs the echo waits for the prompt's logprobs (in the first delta)
        echo_lps = req.echo and req.logprobs is not None
        try:
            if req.echo and not echo_lps:
                for i, run in enumerate(runs):
                    text = self._echo_text(run.prompt)
                    for j in range(n):
                        offsets[i * n + j] = len(text)
                        yield chunk([CompletionChoice(index=i * n + j, text=text)])
            async for i, d in deltas:
                index = i * n + d.index
                generated += len(d.new_token_ids)
                if echo_lps and d.prompt_logprobs is not None:
                    text = self._echo_text(runs[i].prompt)
                    lp, _ = self._echo_logprobs(runs[i].prompt, d.prompt_logprobs,
                                                req.return_tokens_as_token_ids)
                    offsets[index] = len(text)
                    yield chunk([CompletionChoice(index=index, text=text, logprobs=lp)])
                lp = None
                if req.logprobs is not None and d.new_token_ids:
                    lp, offsets[index] = self._completion_logprobs(
                        d.new_token_ids, d.new_logprobs or [], offsets[index],
                        req.return_tokens_as_token_ids)
                if not (d.new_text or d.finished or lp):
                    continue
                yield chunk([CompletionChoice(
                    index=index, text=d.new_text, logprobs=lp,
                    finish_reason=d.finish_reason if d.finished else None,
                    stop_reason=d.stop_reason if d.finished else None,
                    token_ids=d.new_token_ids if req.return_token_ids else None)])
            if req.include_usage:
                yield chunk([], UsageInfo.of(sum(len(r.prompt.token_ids) for r in runs),
                                             generated))
        except Exception as exc:
            yield self._error_event(exc)
        finally:
            await deltas.aclose()
            await self._close(runs)
        yield DONE
