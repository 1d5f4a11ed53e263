"""The proxy's HTTP routes (`kdaserve proxy`, kdaserve/disagg/proxy.py): the two completion
endpoints through the prefill/decode split, /v1/models from the least loaded decode
instance, /health over both pools, and the proxy's counters on /metrics."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kdaserve.disagg.proxy import Proxy
from kdaserve.server.errors import install_error_handlers


def build_proxy_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="kdaserve proxy", docs_url=None, redoc_url=None)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        lines = [f"kdaserve_proxy_{k}_total {v}" for k, v in proxy.counts.items()]
        return Response("\n".join(lines) + "\n", media_type="text/plain")

    return app
