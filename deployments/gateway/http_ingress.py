"""HTTP ingress: the OpenAI-compatible API (FastAPI), plus gRPC methods on the same deployment.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(server-sent events when ``stream`` is true), ``GET /healthz``, OpenAPI at ``/docs``.
Every response names the pool and replica that served it (``x-deltaserve-pool``,
``x-deltaserve-replica`` headers and the ``model`` field). Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` with the matching status code.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.gateway.protocol import ChatMessage, CompletionInput, Finished, TextDelta
from deployments.gateway.errors import ApiError, BadRequest, InternalError

log = logging.getLogger("deltaserve.http")


class _OpenAIRequest(BaseModel):
    # OpenAI rejects unknown parameters ("Unrecognized request argument supplied"): so do we.
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="model id: '<model>' (standard) or '<model>-highspeed'")
    max_tokens: int | None = Field(None, description="tokens to generate (default 16)")
    temperature: float = Field(1.0, description="0 = greedy")
    top_p: float = Field(1.0)
    n: int = Field(1, description="only 1 is supported")
    stream: bool = False
    stream_options: dict[str, Any] | None = Field(None, description="include_usage: a last chunk with usage; with "
                                                  "continuous_usage_stats (as vLLM's) every chunk also carries usage so far")
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = Field(False, description="deltaserve extension: do not stop at end-of-sequence")
    cache_salt: str | None = Field(None, description="cache salt (as vLLM's): only requests with the same salt share cached prefixes; narrows the tenant's own namespace")

    def common(self) -> dict:
        if self.n != 1:
            raise BadRequest(f"n must be 1, got {self.n}", param="n")
        if self.presence_penalty or self.frequency_penalty:
            raise BadRequest("presence_penalty and frequency_penalty are not supported (must be 0)", param="presence_penalty")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return dict(model=self.model, max_tokens=16 if self.max_tokens is None else self.max_tokens,
                    temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                    cache_salt=self.cache_salt)


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str] = Field(description="the prompt (a list must hold exactly one string)")
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def to_input(self, session_id: str | None) -> CompletionInput:
        if self.echo or self.logprobs is not None or self.suffix is not None:
            raise BadRequest("echo, logprobs and suffix are not supported", param="echo")
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise BadRequest(f"prompt lists must hold exactly one string, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        return CompletionInput(prompt=prompt, session_id=session_id, **self.common())


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[_Message]
    max_completion_tokens: int | None = None

    def to_input(self, session_id: str | None) -> CompletionInput:
        common = self.common()
        if self.max_completion_tokens is not None:
            common["max_tokens"] = self.max_completion_tokens
        msgs = tuple(ChatMessage("system" if m.role == "developer" else m.role, m.content) for m in self.messages)
        return CompletionInput(messages=msgs, session_id=session_id, **common)


def error_response(err: ApiError | Exception) -> JSONResponse:
    status = getattr(err, "status", 500)
    body = {"error": {"message": getattr(err, "message", None) or str(err) or "internal error",
                      "type": getattr(err, "type", "invalid_request_error" if status < 500 else "server_error"),
                      "param": getattr(err, "param", None), "code": getattr(err, "code", None)}}
    headers = {}
    retry = getattr(err, "retry_after_s", None)
    if retry is not None:
        headers["retry-after"] = str(max(1, int(-(-retry // 1))))
    return JSONResponse(body, status_code=status, headers=headers)


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    return auth if auth else request.headers.get("x-api-key")


def _usage_json(fin: Finished) -> dict:
    u = fin.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "timings": {"time_to_first_token_s": round(u.time_to_first_token_s, 6),
                    "output_tokens_per_s": round(u.output_tokens_per_s, 3),
                    "end_to_end_s": round(u.end_to_end_s, 6)},
    }


def _headers(fin: Finished | None, pool: str) -> dict:
    return {"x-deltaserve-pool": pool, "x-deltaserve-replica": fin.replica if fin else "",
            "x-deltaserve-request-id": fin.request_id if fin else ""}


async def _first(events: AsyncIterator) -> list:
    """Pull events until the first text or the end: errors surface before any byte is sent."""
    got = []
    async for ev in events:
        got.append(ev)
        if isinstance(ev, Finished) or (isinstance(ev, TextDelta) and ev.text):
            break
    return got


def build_http_app() -> FastAPI:
    app = FastAPI(title="deltaserve", version="0.1.0",
                  description="OpenAI-compatible API for Kimi-K3-family models; two pools: '<model>' and '<model>-highspeed'.")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(BadRequest(f"request body is not valid JSON: {first.get('msg')}"))
        if first.get("type") == "extra_forbidden":
            return error_response(BadRequest(f"Unrecognized request argument supplied: {'.'.join(loc)}", param=".".join(loc)))
        return error_response(BadRequest(f"invalid request: {'.'.join(loc) or 'body'}: {first.get('msg')}", param=".".join(loc) or None))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc)

    return app


app = build_http_app()


class IngressRoutes:
    """Mixed into the ingress deployment class (see app.py); ``self.frontend`` serves the requests."""

    @app.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok", "models": sorted(self.frontend.model_ids())}

    @app.get("/v1/models")
    async def models(self, request: Request):
        try:
            cards = self.frontend.list_models(_api_key(request))
        except Exception as e:  # tenants errors carry .status
            return error_response(e) if hasattr(e, "status") else _internal(e)
        return {"object": "list", "data": [{"id": c.id, "object": "model", "created": 0, "owned_by": c.owned_by,
                                            "pool": c.pool} for c in cards]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await self._serve(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self._serve(body, request, chat=True)

    async def _serve(self, body, request: Request, *, chat: bool):
        created = int(time.time())
        try:
            inp = body.to_input(request.headers.get("x-session-id"))
            events = self.frontend.complete(_api_key(request), inp)
            head = await _first(events)
        except ValidationError as e:
            return error_response(BadRequest(str(e)))
        except Exception as e:
            return error_response(e) if hasattr(e, "status") else _internal(e)
        pool = self.frontend.resolve(inp.model)
        if not body.stream:
            text, fin = [], None
            async for ev in _chain(head, events):
                if isinstance(ev, TextDelta):
                    text.append(ev.text)
                else:
                    fin = ev
            content = "".join(text)
            choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": fin.finish_reason}
                      if chat else {"index": 0, "text": content, "finish_reason": fin.finish_reason, "logprobs": None})
            return JSONResponse({"id": fin.request_id, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": fin.model, "choices": [choice], "usage": _usage_json(fin),
                                 "system_fingerprint": fin.pool}, headers=_headers(fin, pool))
        opts = body.stream_options or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        return StreamingResponse(_sse(_chain(head, events), chat, created, include_usage, inp.model, continuous),
                                 media_type="text/event-stream", headers={"x-deltaserve-pool": pool, "cache-control": "no-cache"})


async def _chain(head: list, rest: AsyncIterator):
    for ev in head:
        yield ev
    async for ev in rest:
        yield ev


async def _sse(events: AsyncIterator, chat: bool, created: int, include_usage: bool, model: str,
               continuous: bool = False) -> AsyncIterator[str]:
    """One SSE event per :class:`TextDelta` (its text may hold several tokens), then the finish
    event, the usage event (``include_usage``) and ``[DONE]``. ``continuous``: every text
    event also carries ``usage`` so far (vLLM's ``continuous_usage_stats``)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    first = True
    rid = ""
    n_out = 0
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                rid = ev.request_id
                delta = {"role": "assistant", "content": ev.text} if chat and first else {"content": ev.text}
                choice = {"index": 0, "delta": delta, "finish_reason": None} if chat else \
                    {"index": 0, "text": ev.text, "finish_reason": None, "logprobs": None}
                first = False
                event = {'id': rid, 'object': obj, 'created': created, 'model': model, 'choices': [choice]}
                if continuous:
                    n_out += len(ev.token_ids)
                    event["usage"] = {"prompt_tokens": ev.prompt_tokens, "completion_tokens": n_out,
                                      "total_tokens": ev.prompt_tokens + n_out}
                yield f"data: {json.dumps(event)}\n\n"
            else:
                rid = ev.request_id
                choice = {"index": 0, "delta": {}, "finish_reason": ev.finish_reason} if chat else \
                    {"index": 0, "text": "", "finish_reason": ev.finish_reason, "logprobs": None}
                meta = {"pool": ev.pool, "replica": ev.replica}
                yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': ev.model, 'choices': [choice], 'deltaserve': meta})}\n\n"
                if include_usage:
                    yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': ev.model, 'choices': [], 'usage': _usage_json(ev)})}\n\n"
    except Exception as e:
        log.exception("stream failed")
        yield f"data: {json.dumps({'error': {'message': getattr(e, 'message', str(e)), 'type': 'server_error', 'code': getattr(e, 'code', None)}})}\n\n"
    yield "data: [DONE]\n\n"


def _internal(e: Exception) -> JSONResponse:
    log.exception("internal error", exc_info=e)
    return error_response(InternalError("internal error"))
