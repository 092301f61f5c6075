"""HTTP ingress: the OpenAI-compatible API (FastAPI).

Endpoints: ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (server-sent events when ``stream`` is true), ``POST /v1/tasks/{task_id}``
(a task's outcome, :mod:`deployments.tenancy.ledger`), ``GET /healthz``, OpenAPI at ``/docs``. Every response names the pool and replica that served it
(``x-deltaserve-pool``, ``x-deltaserve-replica`` headers and the ``model`` field) and the
request id (``x-deltaserve-request-id``, the completion's ``id``, and the id in the logs).

Every error, unknown routes and wrong methods included, has OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` with the matching status code, rendered by
the one mapping :func:`deployments.gateway.errors.http_error` (which logs each 5xx once with its
request id). A stream that fails after its first byte ends with ``data: {"error": …}`` and
``data: [DONE]``.

OpenAI parameters this platform does not implement are declared (so the 400 names them as
unsupported, :data:`UNSUPPORTED`); a value equal to the parameter's no-op (``echo: false``,
``best_of: 1``, ``tools: []``…) is accepted. Anything else unknown is "Unrecognized".
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import inspect
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.gateway.frontend import merge_events
from deployments.gateway.protocol import (ChatMessage, CompletionInput, Finished, RequestLimits, TextDelta,
                                          TokenLogprobs, usage_over_prompts)
from deployments.observability import tracing
from deployments.gateway.affinity import AFFINITY_HEADER, parse_affinity_header
from deployments.gateway.errors import (ApiError, BadRequest, MethodNotAllowed, NotFound, PayloadTooLarge,
                                        RequestTimeout, UnsupportedParameter, http_error)
from deployments.tenancy.ledger import UsageLedger, report_task_outcome

#: OpenAI parameters the platform does not implement → the values that mean "off" (accepted).
UNSUPPORTED: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "logit_bias": (None, {}),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "service_tier": (None, "auto", "default"), "store": (None, False), "metadata": (None, {}),
    "reasoning_effort": (None,), "suffix": (None, ""), "echo": (None, False), "best_of": (None, 1),
}
_UNSUPPORTED_DOC = "not supported by this platform: any value but its no-op is a 400 (unsupported_parameter)"
_LIMITS = RequestLimits()


def _unsupported(**defaults: Any) -> Any:
    return Field(None, description=_UNSUPPORTED_DOC, **defaults)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="a last chunk with the request's usage")
    continuous_usage_stats: bool = Field(False, description="(vLLM's) with include_usage, every chunk also carries usage so far")


class _OpenAIRequest(BaseModel):
    # OpenAI rejects unknown parameters ("Unrecognized request argument supplied"): so do we.
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="model id: '<model>' (standard) or '<model>-highspeed'")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate per choice")
    temperature: float | None = Field(None, description="in [0, 2] (default 1); 0 = greedy")
    top_p: float | None = Field(None, description="in (0, 1] (default 1)")
    n: int | None = Field(None, description=f"choices to generate, 1 to {_LIMITS.max_n} (default 1); with a seed, "
                          "choice i uses seed + i; n * max_tokens counts against the tenant's tokens/min")
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description=f"up to {_LIMITS.max_stop} strings of at most "
                                         f"{_LIMITS.max_stop_chars} characters each")
    seed: int | None = Field(None, description="int64; the same seed and parameters give the same output")
    user: str | None = Field(None, description=f"the end user (at most {_LIMITS.max_id_chars} characters): recorded on the request's trace")
    presence_penalty: float | None = Field(None, description="in [-2, 2] (default 0)")
    frequency_penalty: float | None = Field(None, description="in [-2, 2] (default 0)")
    ignore_eos: bool = Field(False, description="deltaserve extension: do not stop at end-of-sequence")
    cache_salt: str | None = Field(None, description="cache salt (as vLLM's): only requests with the same salt share "
                                   "cached prefixes; narrows the tenant's own namespace")
    tools: Any = _unsupported()
    tool_choice: Any = _unsupported()
    parallel_tool_calls: Any = _unsupported()
    functions: Any = _unsupported()
    function_call: Any = _unsupported()
    response_format: Any = _unsupported()
    logit_bias: Any = _unsupported()
    audio: Any = _unsupported()
    modalities: Any = _unsupported()
    prediction: Any = _unsupported()
    web_search_options: Any = _unsupported()
    service_tier: Any = _unsupported()
    store: Any = _unsupported()
    metadata: Any = _unsupported()
    reasoning_effort: Any = _unsupported()

    def common(self) -> dict:
        bad = [k for k in UNSUPPORTED if k in self.model_fields_set and getattr(self, k) not in UNSUPPORTED[k]]
        if bad:
            raise UnsupportedParameter(f"Unsupported parameter{'s' if len(bad) > 1 else ''}: {', '.join(bad)}: "
                                       "not supported by this platform", param=bad[0])
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return dict(model=self.model, max_tokens=self.max_tokens,
                    temperature=1.0 if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p, n=1 if self.n is None else self.n,
                    seed=self.seed, stop=stop, ignore_eos=self.ignore_eos, cache_salt=self.cache_salt, user=self.user,
                    presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0)


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description=f"the prompt: a string or a list of token ids; or up to {_LIMITS.max_prompts} prompts, a list of "
                    "strings or of token-id lists (choice i*n + j is prompt i's choice j); literal control-token "
                    "strings in a string are plain text unless allow_special_tokens")
    logprobs: int | None = Field(None, description=f"0 to {_LIMITS.max_logprobs}: each token's logprob and this "
                                 "many most likely alternatives")
    allow_special_tokens: bool = Field(False, description="deltaserve extension: literal control-token strings in the "
                                       "prompt (e.g. '<|im_end|>') encode as those control tokens; default: as plain text")
    echo: Any = _unsupported()
    suffix: Any = _unsupported()
    best_of: Any = _unsupported()

    def to_inputs(self, session_id: str | None, task_id: str | None = None) -> list[CompletionInput]:
        """One input per prompt: a string or token ids is one; a list of strings or of token-id lists, one each."""
        common = self.common()
        prompt = self.prompt
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not prompts:
            raise BadRequest("the prompt list is empty", param="prompt")
        if len(prompts) > _LIMITS.max_prompts:
            raise BadRequest(f"prompt may hold at most {_LIMITS.max_prompts} prompts, got {len(prompts)}",
                             param="prompt")
        n = common["n"]
        if len(prompts) > 1 and len(prompts) * n > _LIMITS.max_prompts:
            # one request's streams stay within what a pool queues on `make serve`'s defaults (64 streams of the
            # ingress's queue): 32 prompts x n 8 were refused 503 there every time, which no retry mends
            raise BadRequest(f"prompts x n may be at most {_LIMITS.max_prompts} choices, got {len(prompts)} x {n}",
                             param="n")
        if len(prompts) > 1 and session_id is not None:
            raise BadRequest(f"x-session-id names one conversation: send one prompt with it, got {len(prompts)}",
                             param="x-session-id")
        return [CompletionInput(prompt=p if isinstance(p, str) else None,
                                prompt_ids=None if isinstance(p, str) else tuple(p), session_id=session_id,
                                task_id=task_id, logprobs=self.logprobs, allow_special_tokens=self.allow_special_tokens,
                                **common) for p in prompts]


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # other part types carry other fields: they are named in the 400
    type: str = Field(description="only 'text' is supported")
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str = Field(description="'system', 'developer' (as system), 'user' or 'assistant'")
    content: str | list[_ContentPart] = Field(description="a string, or a list of text parts "
                                              f"(at most {_LIMITS.max_content_parts}) joined in order")
    name: str | None = None
    tool_calls: Any = _unsupported()
    tool_call_id: Any = _unsupported()
    function_call: Any = _unsupported()
    refusal: Any = _unsupported()
    audio: Any = _unsupported()

    def to_message(self, i: int) -> ChatMessage:
        bad = [k for k in ("tool_calls", "tool_call_id", "function_call", "refusal", "audio")
               if getattr(self, k) is not None]
        if bad:
            raise UnsupportedParameter(f"Unsupported parameter: messages[{i}].{bad[0]}: not supported by this platform",
                                       param=f"messages.{i}.{bad[0]}")
        content = self.content
        if isinstance(content, list):
            if len(content) > _LIMITS.max_content_parts:
                raise BadRequest(f"messages[{i}].content may hold at most {_LIMITS.max_content_parts} parts, got "
                                 f"{len(content)}", param=f"messages.{i}.content")
            other = sorted({p.type for p in content if p.type != "text"})
            if other:
                raise UnsupportedParameter(f"messages[{i}].content: unsupported content part type(s) "
                                           f"{[t[:40] for t in other]}; only 'text' is supported",
                                           param=f"messages.{i}.content")
            if any(p.text is None for p in content):
                raise BadRequest(f"messages[{i}].content: a text part needs 'text'", param=f"messages.{i}.content")
            content = "".join(p.text for p in content)
        return ChatMessage("system" if self.role == "developer" else self.role, content)


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[_Message] = Field(description=f"at most {_LIMITS.max_messages} messages")
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate per choice; wins over "
                                              "max_tokens (default: the rest of the tenant's context)")
    logprobs: bool | None = Field(None, description="each output token's logprob")
    top_logprobs: int | None = Field(None, description=f"with logprobs: 0 to {_LIMITS.max_logprobs} most likely "
                                     "alternatives per token")

    def to_input(self, session_id: str | None, task_id: str | None = None) -> CompletionInput:
        common = self.common()
        if self.max_completion_tokens is not None:
            common["max_tokens"] = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        if len(self.messages) > _LIMITS.max_messages:
            raise BadRequest(f"messages may hold at most {_LIMITS.max_messages} messages, got {len(self.messages)}",
                             param="messages")
        msgs = tuple(m.to_message(i) for i, m in enumerate(self.messages))
        return CompletionInput(messages=msgs, session_id=session_id, task_id=task_id, logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                               **common)


class TaskOutcomeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    outcome: Literal["success", "failure"] = Field(description="how the task the client grouped with x-task-id "
                                                   "ended: its spend counts toward cost per successful task")


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    return auth if auth else request.headers.get("x-api-key")


def _affinity(request: Request) -> bool:
    """Whether the request's prefill may be routed by cache affinity (``x-deltaserve-affinity``)."""
    try:
        return parse_affinity_header(request.headers.get(AFFINITY_HEADER))
    except ValueError as e:
        raise BadRequest(str(e), param=AFFINITY_HEADER) from None


def _request_id(request: Request, prefix: str = "req") -> str:
    """The request's id, made once when the request arrives; every response and log line carries it."""
    rid = getattr(request.state, "deltaserve_request_id", None)
    if rid is None:
        rid = request.state.deltaserve_request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
    return rid


def _error(exc: BaseException, request_id: str) -> JSONResponse:
    status, body, headers = http_error(exc, request_id)
    return JSONResponse(body, status_code=status, headers={**headers, "x-deltaserve-request-id": request_id})


def _usage_json(u) -> dict:
    """OpenAI's usage, plus ``timings`` and (a priced pool) ``cost``, USD, with its parts in ``cost_details``:
    ``input`` (prompt tokens computed), ``cached_input`` (prompt tokens from the cache), ``output``."""
    out = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "timings": {"time_to_first_token_s": round(u.time_to_first_token_s, 6),
                    "output_tokens_per_s": round(u.output_tokens_per_s, 3),
                    "end_to_end_s": round(u.end_to_end_s, 6)},
    }
    cost = u.cost
    if cost is not None:
        out["cost"], out["cost_details"] = cost.usd(), cost.details_usd()
    return out


class TextOffsets:
    """Where each token of one choice starts in its text, in characters (OpenAI's ``text_offset``).

    A token's ``token`` string is not its share of the text: a byte-level token may hold part of a
    UTF-8 character, which the text shows only once complete. The bytes go through the same
    incremental UTF-8 decoding (invalid bytes -> U+FFFD) as the text, so a token's offset is the
    characters decoded from the tokens before it: a token that completes a character starts where
    that character does, and the offsets never run past the text."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def of(self, entries: list[TokenLogprobs]) -> list[int]:
        out = []
        for e in entries:
            out.append(self._chars)
            self._chars += len(self._decoder.decode(bytes(e.bytes)))
        return out


def _completion_logprobs(entries: list[TokenLogprobs], offsets: TextOffsets) -> dict:
    """OpenAI's completions ``logprobs`` object (``text_offset``: :class:`TextOffsets`, of this choice)."""
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{a.token: a.logprob for a in e.top} for e in entries], "text_offset": offsets.of(entries)}


def _chat_logprobs(entries: list[TokenLogprobs]) -> dict:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in e.top]}
                        for e in entries], "refusal": None}


async def _first(events: AsyncIterator) -> list:
    """Pull events until the first text or the end: errors surface before any byte is sent."""
    got = []
    async for ev in events:
        got.append(ev)
        if isinstance(ev, Finished) or (isinstance(ev, TextDelta) and ev.text):
            break
    return got


async def _chain(head: list, rest: AsyncIterator):
    for ev in head:
        yield ev
    async for ev in rest:
        yield ev


async def _reindexed(events: AsyncIterator, offset: int):
    """A prompt's events with their choice index moved past the earlier prompts' choices."""
    async for ev in events:
        yield dataclasses.replace(ev, index=ev.index + offset)


class _RefusedWithSibling(BadRequest):
    """A prompt of a multi-prompt completion that was admitted, failed because another prompt was refused."""


class _AdmittedTogether:
    """The requests of one multi-prompt completion start only once every one is admitted, so a prompt refused
    (over the context, the tenant's rate) refuses the whole before any prompt is prefilled or charged."""

    def __init__(self, requests: int) -> None:
        self.left, self.go, self.refused = requests, asyncio.Event(), False

    async def admitted(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.go.set()
        await self.go.wait()
        if self.refused:
            raise _RefusedWithSibling("another prompt of this request was refused", param="prompt")

    def refuse(self) -> None:
        self.refused = True
        self.go.set()


async def _first_of_all(streams: list[AsyncIterator], n: int, together: _AdmittedTogether | None) -> AsyncIterator:
    """:func:`_first` of every stream at once (their prompts admitted together, then prefilled side by side);
    the first error in prompt order (a sibling's own refusal before the others') closes them all and is raised;
    else their events as one stream, prompt ``i``'s choices at ``i * n + j``."""
    async def first(s: AsyncIterator) -> list:
        try:
            return await _first(s)
        except BaseException:
            if together is not None:
                together.refuse()
            raise

    try:
        heads = await asyncio.gather(*(first(s) for s in streams), return_exceptions=True)
        errors = [(i, h) for i, h in enumerate(heads) if isinstance(h, BaseException)]
        if errors:
            i, err = next(((i, e) for i, e in errors if not isinstance(e, _RefusedWithSibling)), errors[0])
            if len(streams) > 1 and isinstance(err, ApiError) and err.status in (400, 429):
                err.message = f"prompt {i}: {err.message}"  # which of the prompts (a 401 / 403 / 404 is everyone's)
            raise err
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    if len(streams) == 1:
        return _chain(heads[0], streams[0])
    return merge_events([_reindexed(_chain(h, s), i * n) for i, (h, s) in enumerate(zip(heads, streams))])


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413 before anything parses it
    (by ``Content-Length``, or by counting the bytes of a chunked body as they arrive), and a body that has not
    arrived whole ``timeout_s`` after the request reached the ingress is a 408, so a client that trickles its body
    or stops sending it holds an ingress slot no longer than that."""

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    @staticmethod
    async def _reject(send, err: ApiError) -> None:
        rid = f"req-{uuid.uuid4().hex[:24]}"
        status, body, _ = http_error(err, rid)
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"x-deltaserve-request-id", rid.encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})

    def _too_large(self, what: str) -> PayloadTooLarge:
        return PayloadTooLarge(f"the request body is {what}; the limit is {self.max_bytes} bytes")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._reject(send, self._too_large(f"{length.decode('latin-1')[:20]} bytes (Content-Length)"))
        body, err = bytearray(), None
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] != "http.request":
                        return  # the client went away
                    body += msg.get("body", b"")
                    if len(body) > self.max_bytes:
                        err = self._too_large(f"over {len(body)} bytes")
                        break
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            err = RequestTimeout(f"the request body did not arrive within {self.timeout_s:g} s (got {len(body)} bytes)")
        if err is not None:
            return await self._reject(send, err)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# FastAPI's own OpenTelemetry (0.165 and later) turns on once a global tracer provider is set, as the replicas set
# one: every request would also get a trace of its own ("POST /v1/completions" and its dependency and endpoint spans)
# beside the request's trace that the ``ingress`` span roots (deployments.observability.tracing), and every chunk of a
# stream would pass through its wrapper of ``send`` (0.15-0.2 ms of CPU per 10-chunk request, measured). Off: the
# ``ingress`` span is the request's server span, and the platform counts requests in its own metrics.
_FASTAPI_TELEMETRY_OFF = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                          if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def build_http_app(limits: RequestLimits = _LIMITS) -> FastAPI:
    """The FastAPI app without routes: error handlers and the body limit (routes: :class:`IngressRoutes`)."""
    app = FastAPI(title="deltaserve", version="0.1.0",
                  description="OpenAI-compatible API for Kimi-K3-family models; two pools: '<model>' and '<model>-highspeed'.",
                  **_FASTAPI_TELEMETRY_OFF)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        if first.get("type") == "json_invalid":
            err = BadRequest(f"request body is not valid JSON: {first.get('msg')}")
        elif first.get("type") == "extra_forbidden":
            err = BadRequest(f"Unrecognized request argument supplied: {where[:100]}", param=where[:100])
        elif loc[:1] == ["prompt"] and first.get("type") != "missing":  # which member of the union failed says little
            err = BadRequest("prompt must be a string, a list of token ids (integers), or a list of strings or of "
                             "token-id lists (several prompts)", param="prompt")
        else:
            err = BadRequest(f"invalid request: {where or 'body'}: {first.get('msg')}", param=where or None)
        return _error(err, _request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        method, path = request.method, request.url.path[:200]
        if exc.status_code == 404:
            err: ApiError = NotFound(f"Unknown route: {method} {path}")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"Method {method} is not allowed on {path}")
        else:
            err = BadRequest(f"invalid request to {method} {path}")
            err.status = exc.status_code if 400 <= exc.status_code < 500 else 400
        resp = _error(err, _request_id(request))
        if exc.headers and "allow" in {k.lower() for k in exc.headers}:
            resp.headers["allow"] = next(v for k, v in exc.headers.items() if k.lower() == "allow")
        return resp

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error(exc, _request_id(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return _error(exc, _request_id(request))

    return app


app = build_http_app()
_ROUTES: list[tuple[str, str, str]] = []  # (method, path, IngressRoutes method name): see standalone_app


def _route(method: str, path: str) -> Callable:
    def register(fn: Callable) -> Callable:
        _ROUTES.append((method, path, fn.__name__))
        return app.api_route(path, methods=[method])(fn)

    return register


class IngressRoutes:
    """Mixed into the ingress deployment class (see ingress.py); ``self.frontend`` serves the requests."""

    frontend: Any
    ledger: UsageLedger | None = None  # the usage ledger (tasks); None: no task is known

    @_route("GET", "/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok", "models": sorted(self.frontend.model_ids())}

    @staticmethod
    def _card(c) -> dict:
        return {"id": c.id, "object": "model", "created": c.created, "owned_by": c.owned_by, "pool": c.pool,
                "max_model_len": c.max_model_len}

    @_route("GET", "/v1/models")
    async def models(self, request: Request):
        try:
            cards = self.frontend.list_models(_api_key(request))
        except Exception as e:
            return _error(e, _request_id(request))
        return {"object": "list", "data": [self._card(c) for c in cards]}

    @_route("GET", "/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        try:
            return self._card(self.frontend.model_card(_api_key(request), model))
        except Exception as e:
            return _error(e, _request_id(request))

    @_route("POST", "/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await self._serve(body, request, chat=False)

    @_route("POST", "/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self._serve(body, request, chat=True)

    @_route("POST", "/v1/tasks/{task_id}")
    async def task_outcome(self, task_id: str, body: TaskOutcomeRequest, request: Request):
        """Report how a task (the requests sent with ``x-task-id: <task_id>``) ended. The same outcome
        again answers as before; a different one is 409; a task the caller's tenant never named is 404."""
        rid = _request_id(request)
        try:
            report = await report_task_outcome(self.frontend, self.ledger, _api_key(request), task_id, body.outcome)
        except Exception as e:
            return _error(e, rid)
        return JSONResponse(report.json(), headers={"x-deltaserve-request-id": rid})

    async def _serve(self, body, request: Request, *, chat: bool):
        created = int(time.time())
        rid = _request_id(request, "chatcmpl" if chat else "cmpl")
        try:
            ids = (request.headers.get("x-session-id"), request.headers.get("x-task-id"))
            inputs = [body.to_input(*ids)] if chat else body.to_inputs(*ids)
            if not _affinity(request):
                inputs = [dataclasses.replace(inp, affinity=False) for inp in inputs]
            inp = inputs[0]
            # a completion of several prompts is a request per prompt (ids <rid>-<i>), admitted together: the first
            # error of any refuses the whole before a byte is sent, and their events merge into one response
            parent = tracing.client_carrier(request.headers)
            key = _api_key(request)
            together = _AdmittedTogether(len(inputs)) if len(inputs) > 1 else None
            streams = [self.frontend.complete(key, x, request_id=rid if len(inputs) == 1 else f"{rid}-{i}",
                                              trace_parent=parent, admitted=together and together.admitted)
                       for i, x in enumerate(inputs)]
            events = await _first_of_all(streams, inp.n, together)
            pool = self.frontend.resolve(inp.model)
            choices = len(inputs) * inp.n
            if not body.stream:
                return await _whole(events, chat, created, rid, pool, choices, inp.logprobs is not None, inp.n)
        except Exception as e:
            return _error(e, rid)
        if body.stream:
            opts = body.stream_options or _StreamOptions()
            stream = _sse(events, chat, created, opts.include_usage, inp.model, rid, choices,
                          opts.include_usage and opts.continuous_usage_stats, inp.n)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"x-deltaserve-pool": pool, "x-deltaserve-request-id": rid,
                                              "cache-control": "no-cache"})


async def _collect(events: AsyncIterator, n: int) -> tuple[list[list[str]], list[list[TokenLogprobs]], list[Finished]]:
    text: list[list[str]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprobs]] = [[] for _ in range(n)]
    fins: list[Finished] = []
    async for ev in events:
        if isinstance(ev, TextDelta):
            text[ev.index].append(ev.text)
            lps[ev.index].extend(ev.logprobs)
        else:
            fins.append(ev)
    return text, lps, sorted(fins, key=lambda f: f.index)


async def _whole(events: AsyncIterator, chat: bool, created: int, rid: str, pool: str, n: int,
                 logprobs: bool, per_prompt: int) -> JSONResponse:
    """The whole completion as one response: its ``n`` choices by index (``per_prompt`` of them for each
    prompt), the usage summed."""
    text, lps, fins = await _collect(events, n)
    choices = []
    for fin in fins:
        content, lp = "".join(text[fin.index]), lps[fin.index]
        if chat:
            choices.append({"index": fin.index, "message": {"role": "assistant", "content": content},
                            "finish_reason": fin.finish_reason, "logprobs": _chat_logprobs(lp) if logprobs else None})
        else:
            choices.append({"index": fin.index, "text": content, "finish_reason": fin.finish_reason,
                            "logprobs": _completion_logprobs(lp, TextOffsets()) if logprobs else None})
    last = fins[-1]
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": last.model, "choices": choices, "usage": _usage_json(usage_over_prompts(fins, per_prompt)),
                         "system_fingerprint": last.pool},
                        headers={"x-deltaserve-pool": pool, "x-deltaserve-replica": last.replica,
                                 "x-deltaserve-request-id": rid})


async def _sse(events: AsyncIterator, chat: bool, created: int, include_usage: bool, model: str, rid: str, n: int,
               continuous: bool = False, per_prompt: int | None = None) -> AsyncIterator[str]:
    """One SSE event per :class:`TextDelta` (its text may hold several tokens; ``index`` names
    its choice, ``per_prompt`` of them for each prompt), a finish event per choice, then the usage event
    (``include_usage``) and ``[DONE]``. ``continuous``: every text event also carries ``usage`` so far (vLLM's
    ``continuous_usage_stats``; the prompts' tokens as far as their first events have come). An error after the
    first byte is an ``error`` event, then ``[DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    per_prompt = per_prompt or n
    started = [False] * n
    offsets = [TextOffsets() for _ in range(n)]
    prompt_tokens: dict[int, int] = {}  # prompt -> its prompt tokens (from its events)
    n_out = 0
    fins: list[Finished] = []
    try:
        async for ev in events:
            i = ev.index
            if isinstance(ev, TextDelta):
                if chat:
                    delta = {"role": "assistant", "content": ev.text} if not started[i] else {"content": ev.text}
                    choice = {"index": i, "delta": delta, "finish_reason": None,
                              "logprobs": _chat_logprobs(list(ev.logprobs)) if ev.logprobs else None}
                else:
                    choice = {"index": i, "text": ev.text, "finish_reason": None,
                              "logprobs": _completion_logprobs(list(ev.logprobs), offsets[i]) if ev.logprobs else None}
                started[i] = True
                event = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                if continuous:
                    n_out += len(ev.token_ids)
                    prompt_tokens[i // per_prompt] = ev.prompt_tokens
                    seen = sum(prompt_tokens.values())
                    event["usage"] = {"prompt_tokens": seen, "completion_tokens": n_out, "total_tokens": seen + n_out}
                yield f"data: {json.dumps(event)}\n\n"
            else:
                fins.append(ev)
                choice = {"index": i, "delta": {}, "finish_reason": ev.finish_reason, "logprobs": None} if chat else \
                    {"index": i, "text": "", "finish_reason": ev.finish_reason, "logprobs": None}
                meta = {"pool": ev.pool, "replica": ev.replica}
                yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': ev.model, 'choices': [choice], 'deltaserve': meta})}\n\n"
        if include_usage and fins:
            usage = _usage_json(usage_over_prompts(fins, per_prompt))
            yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': model, 'choices': [], 'usage': usage})}\n\n"
    except Exception as e:
        _, body, _ = http_error(e, rid)
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


def standalone_app(frontend) -> FastAPI:
    """The same API served by ``frontend`` in this process, without Serve (tests, benchmarks):
    :class:`IngressRoutes`' routes bound to one instance (tasks: the :class:`UsageLedger` among its observers)."""

    class _Local(IngressRoutes):
        def __init__(self) -> None:
            self.frontend = frontend
            self.ledger = next((o for o in frontend.observers if isinstance(o, UsageLedger)), None)

    owner = _Local()
    local = build_http_app()
    for method, path, name in _ROUTES:
        local.add_api_route(path, getattr(owner, name), methods=[method])
    return local
