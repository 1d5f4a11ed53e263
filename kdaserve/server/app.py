"""The OpenAI-compatible HTTP API over an `AsyncEngine`: the FastAPI app, its routes and
middleware. The endpoints' logic is in serving.py, serving_completions.py and serving_chat.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kdaserve.config import KVTransferConfig
from kdaserve.engine.async_engine import AsyncEngine
from kdaserve.engine.engine_errors import EngineError
from kdaserve.image_io import ImageLimits
from kdaserve.server.errors import APIError, install_error_handlers
from kdaserve.server.guards import ServerLimits
from kdaserve.server.metrics import CONTENT_TYPE, ServerMetrics
from kdaserve.server.middleware import DEFAULT_MAX_BODY_BYTES, AuthMiddleware, BodyLimitMiddleware
from kdaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kdaserve.server.protocol_responses import ModelCard, ModelList
from kdaserve.server.runs import json_response
from kdaserve.server.serving_chat import ChatServing
from kdaserve.server.serving_completions import CompletionServing
from kdaserve.tokenizer import Tokenizer
from kdaserve.vision_input import VisionInput

__all__ = ["DEFAULT_MAX_BODY_BYTES", "APIError", "OpenAIServing", "build_app"]


class OpenAIServing(CompletionServing, ChatServing):
    """Every endpoint's logic over one engine and tokenizer (one set of runs in flight, one
    drain flag)."""


# ---- the app -------------------------------------------------------------------------------------
def build_app(engine: AsyncEngine, tokenizer: Tokenizer, served_model_name: str,
              max_model_len: int, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              generation_defaults: Mapping[str, Any] | None = None,
              metrics: ServerMetrics | None = None, limits: ServerLimits | None = None,
              public_metrics: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, vision: VisionInput | None = None,
              image_limits: ImageLimits | None = None,
              strict_schemas: bool = True, kv_transfer: KVTransferConfig | None = None
              ) -> FastAPI:
    """`generation_defaults` (SamplingParams names) fill fields a request leaves out. With an
    API key every endpoint but /health needs it; `public_metrics` exempts /metrics too."""
    metrics = metrics or ServerMetrics()
    limits = limits or ServerLimits()
    serving = OpenAIServing(engine, tokenizer, served_model_name, max_model_len,
                            generation_defaults or {}, metrics, limits,
                            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                            vision=vision, image_limits=image_limits,
                            strict_schemas=strict_schemas)
    app = FastAPI(title="kdaserve", docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        open_paths = {"/health", "/metrics"} if public_metrics else {"/health"}
        app.add_middleware(AuthMiddleware, api_key=api_key,   # outermost: runs first
                           open_paths=frozenset(open_paths))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(ModelList(data=[ModelCard(id=served_model_name,
                                               max_model_len=max_model_len)]))

    def engine_stalled() -> bool:
        return engine.seconds_since_heartbeat() > limits.health_timeout_s

    @app.get("/health")
    async def health() -> Response:
        """200 only while the engine process runs and its loop reports in (a stalled or
        stopped engine turns this to 503 within --health-timeout) and no drain is under way."""
        if not engine.is_alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        if engine_stalled():
            raise APIError(503, f"the engine has not reported for "
                           f"{engine.seconds_since_heartbeat():.1f} s", code="engine_stalled")
        if serving.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = None
        if engine.is_alive and not engine_stalled():
            with suppress(EngineError, asyncio.TimeoutError):
                stats = await asyncio.wait_for(engine.stats(), limits.health_timeout_s)
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/kv_transfer")
    async def kv_transfer_info() -> Response:
        """This instance's part in disaggregated serving, for `kdaserve proxy`: its role and,
        for a decode instance, where prefill instances push caches to."""
        kt = kv_transfer
        return JSONResponse({
            "role": kt.role if kt is not None else "colocated",
            "connector": kt.connector if kt is not None else None,
            "address": f"tcp://{kt.host}:{kt.port}" if kt is not None and kt.port else None})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return json_response(await serving.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return json_response(await serving.detokenize(body))

    return app
