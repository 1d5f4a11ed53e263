"""`kdaserve proxy`: the OpenAI-compatible front of a disaggregated deployment.

Each completion first asks the chosen decode instance how many leading tokens of its prompt
it already holds (the hit query: the same request with `kv_transfer_params = {transfer_id,
hold: true}`, answered `{held_tokens}`; the instance pins them for the import). Then it goes
to the least loaded prefill instance with max_tokens = 1 and `kv_transfer_params =
{transfer_id, peer, held_tokens}` (the decode instance's kv-transfer address): it computes the
prompt and the first token, pushes the request's cache but the held tokens to the decode
instance and answers once that instance acknowledged. Then the same request goes to the decode
instance
with `{transfer_id, first_token_id}`; it imports the cache and answers the client, streaming or
not, exactly as `kdaserve serve` would (its response is passed through byte for byte, errors
included). Requests the split does not serve (n > 1, several prompts, logprobs,
prompt_logprobs, max_tokens = 1) go whole to a decode instance, which is a complete engine; a
request whose first token already ends it is answered whole by the prefill instance.

Failures, each bounded in time: a decode instance that is gone or refuses the cache (the
prefill side's send is not acknowledged: a 503 `kv_transfer_failed`) is set aside and the
request starts over on another one; with none left the client gets a 503 naming the cause. A
prefill instance that does not answer within --prefill-timeout is a 504; nothing is held for
the request on the decode side (an arrived cache nobody takes expires there).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kdaserve.disagg.backends import Backend, BackendPool
from kdaserve.server.errors import APIError

logger = logging.getLogger("kdaserve")
_FORWARD_HEADERS = ("authorization",)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], prefill_timeout_s: float = 60.0,
                 connect_timeout_s: float = 5.0, probe_timeout_s: float = 1.0,
                 hit_query_timeout_s: float = 2.0) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout_s))
        self.prefills = BackendPool(prefill, self.client, probe_timeout_s)
        self.decodes = BackendPool(decode, self.client, probe_timeout_s)
        self.prefill_timeout_s = prefill_timeout_s
        self.hit_query_timeout_s = hit_query_timeout_s
        self.counts = {"requests": 0, "disaggregated": 0, "whole": 0, "retries": 0,
                       "failures": 0}

    async def handle(self, path: str, request: Request) -> Response:
        self.counts["requests"] += 1
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        stream = body.get("stream") is True
        if not _splittable(path, body):
            self.counts["whole"] += 1
            why = "no decode instance is configured"
            for decode in await self.decodes.ranked():
                try:
                    return await self._forward(decode, path, body, headers, stream)
                except _Retry as exc:
                    why = str(exc)
                    self.decodes.failed(decode)
            self.counts["failures"] += 1
            raise APIError(503, f"no decode instance could take the request ({why})",
                           code="no_decode_instance")
        self.counts["disaggregated"] += 1
        why = "no decode instance is configured"
        for attempt, decode in enumerate(await self.decodes.ranked()):
            if attempt:
                self.counts["retries"] += 1
            try:
                address = await self.decodes.kv_address(decode, headers)
            except (httpx.HTTPError, ValueError) as exc:
                why = f"{decode.url}: {exc}"
                self.decodes.failed(decode)
                continue
            # a failed import after a hit query (the held prefix was released before the
            # cache came: the decode instance refused it) starts over once on the same
            # instance with the whole prompt, before another instance is tried
            for hit_query in (True, False):
                try:
                    return await self._split(decode, address, path, body, headers, stream,
                                             hit_query)
                except _Retry as exc:
                    why = str(exc)
                    if not (hit_query and exc.held):
                        break
                    self.counts["retries"] += 1
            self.decodes.failed(decode)
        self.counts["failures"] += 1
        raise APIError(503, f"no decode instance could take the request ({why})",
                       code="no_decode_instance")

    async def _split(self, decode: Backend, address: str, path: str, body: dict[str, Any],
                     headers: dict[str, str], stream: bool, hit_query: bool) -> Response:
        """The hit query, the prefill, the decode; _Retry when the cache did not reach
        `decode` or its import failed (`held`: after a hit query that held something)."""
        tid = f"kv-{uuid.uuid4().hex}"
        held = await self._hold(decode, path, body, headers, tid) if hit_query else 0
        prefill = (await self.prefills.ranked())[0]
        first = await self._prefill(prefill, path, body, headers, tid, address, held)
        if isinstance(first, Response):
            return first                         # the prefill instance's own error
        if first == "whole":
            return await self._whole(prefill, path, body, headers, stream)
        dbody = {**body, "kv_transfer_params": {"transfer_id": tid, "first_token_id": first}}
        try:
            return await self._forward(decode, path, dbody, headers, stream)
        except _Retry as exc:
            raise _Retry(str(exc), held=held) from None

    async def _hold(self, decode: Backend, path: str, body: dict[str, Any],
                    headers: dict[str, str], tid: str) -> int:
        """The hit query: how many leading tokens of the request's prompt the decode instance
        holds (pinned there under `tid` for the import). Any failure answers 0: the whole
        prompt travels, as without the query."""
        hbody = {**body, "stream": False,
                 "kv_transfer_params": {"transfer_id": tid, "hold": True}}
        try:
            r = await self.client.post(f"{decode.url}{path}", json=hbody, headers=headers,
                                       timeout=self.hit_query_timeout_s)
            held = r.json().get("held_tokens") if r.status_code == 200 else 0
        except (httpx.HTTPError, ValueError, AttributeError):
            return 0
        return held if isinstance(held, int) and held > 0 else 0

    async def _prefill(self, prefill: Backend, path: str, body: dict[str, Any],
                       headers: dict[str, str], tid: str, peer: str, held: int = 0
                       ) -> int | str | Response:
        """The first token id; "whole" when it ends the request; the prefill instance's error
        response; _Retry when the cache did not reach the decode instance."""
        pbody = {**body, "max_tokens": 1, "stream": False, "return_token_ids": True,
                 "kv_transfer_params": {"transfer_id": tid, "peer": peer,
                                        "held_tokens": held}}
        for k in ("stream_options", "max_completion_tokens"):
            pbody.pop(k, None)
        if isinstance(pbody.get("min_tokens"), int):
            pbody["min_tokens"] = min(pbody["min_tokens"], 1)
        try:
            r = await self.client.post(f"{prefill.url}{path}", json=pbody, headers=headers,
                                       timeout=self.prefill_timeout_s)
        except httpx.TimeoutException:
            self.prefills.failed(prefill)
            self.counts["failures"] += 1
            raise APIError(504, f"the prefill instance {prefill.url} did not answer within "
                           f"{self.prefill_timeout_s:g} s", code="prefill_timeout") from None
        except httpx.TransportError as exc:
            self.prefills.failed(prefill)
            self.counts["failures"] += 1
            raise APIError(503, f"the prefill instance {prefill.url} is unreachable: {exc}",
                           code="prefill_unavailable") from None
        if r.status_code == 503 and _code(r) == "kv_transfer_failed":
            logger.warning("proxy: %s", _message(r))
            raise _Retry(_message(r))
        if r.status_code != 200:
            return _passthrough(r)
        choice = r.json()["choices"][0]
        ids = choice.get("token_ids") or []
        if choice.get("finish_reason") != "length" or not ids:
            return "whole"
        return int(ids[0])

    async def _whole(self, backend: Backend, path: str, body: dict[str, Any],
                     headers: dict[str, str], stream: bool) -> Response:
        try:
            return await self._forward(backend, path, body, headers, stream)
        except _Retry as exc:
            self.counts["failures"] += 1
            raise APIError(503, str(exc), code="backend_unavailable") from None

    async def _forward(self, backend: Backend, path: str, body: dict[str, Any],
                       headers: dict[str, str], stream: bool) -> Response:
        """The backend's answer, passed through (streamed as it comes); _Retry when it is
        unreachable or its cache transfer failed, before anything reached the client."""
        req = self.client.build_request("POST", f"{backend.url}{path}", json=body,
                                        headers=headers)
        try:
            r = await self.client.send(req, stream=True)
        except httpx.TransportError as exc:
            raise _Retry(f"{backend.url} is unreachable: {exc}") from None
        if r.status_code != 200 or not stream:
            try:
                await r.aread()
            except httpx.TransportError as exc:
                raise _Retry(f"{backend.url} went away: {exc}") from None
            finally:
                await r.aclose()
            if r.status_code == 503 and _code(r) == "kv_transfer_failed":
                raise _Retry(_message(r))
            return _passthrough(r)
        return StreamingResponse(_relay(r, backend.url), status_code=200,
                                 media_type=r.headers.get("content-type"),
                                 headers={"Cache-Control": "no-cache"})

    async def models(self, request: Request) -> Response:
        """/v1/models of the least loaded decode instance, passed through."""
        b = (await self.decodes.ranked())[0]
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        try:
            return _passthrough(await self.client.get(f"{b.url}/v1/models", headers=headers))
        except httpx.HTTPError as exc:
            raise APIError(503, f"{b.url}: {exc}", code="backend_unavailable") from None

    async def health(self) -> Response:
        ok = []
        for pool in (self.prefills, self.decodes):
            ranked = await pool.ranked()
            good = False
            for b in ranked[:1]:
                try:
                    good = (await self.client.get(f"{b.url}/health", timeout=2.0)).is_success
                except httpx.HTTPError:
                    good = False
            ok.append(good)
        if not all(ok):
            raise APIError(503, "no healthy " + ("prefill" if not ok[0] else "decode")
                           + " instance", code="backend_unavailable")
        return JSONResponse({"status": "ok"})


class _Retry(Exception):
    def __init__(self, message: str, held: int = 0) -> None:
        super().__init__(message)
        self.held = held


async def _relay(r: httpx.Response, url: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in r.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        # the decode instance died mid-stream: the client gets the server's error event shape
        err = APIError(503, f"the decode instance {url} went away mid-stream: {exc}",
                       code="backend_unavailable")
        yield f"data: {err.body().model_dump_json()}\n\n".encode()
    finally:
        await r.aclose()


def _passthrough(r: httpx.Response) -> Response:
    headers = {k: v for k, v in r.headers.items() if k.lower() == "retry-after"}
    return Response(r.content, status_code=r.status_code, headers=headers,
                    media_type=r.headers.get("content-type"))


def _error(r: httpx.Response) -> dict[str, Any]:
    try:
        err = r.json().get("error")
    except ValueError:
        return {}
    return err if isinstance(err, dict) else {}


def _code(r: httpx.Response) -> str | None:
    return _error(r).get("code")


def _message(r: httpx.Response) -> str:
    return str(_error(r).get("message") or r.text[:500])


def _splittable(path: str, body: dict[str, Any]) -> bool:
    """Requests the prefill/decode split serves; the rest go whole to one instance."""
    if body.get("n", 1) != 1 or body.get("prompt_logprobs") is not None:
        return False
    if body.get("logprobs") not in (None, False):   # the first token's live on the prefill side
        return False
    if "kv_transfer_params" in body:
        return False
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(limit, int) and limit <= 1:
        return False
    if path.endswith("/completions") and "chat" not in path:
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int) and len(p) != 1:
            return False                         # several prompts: several caches
    return True
