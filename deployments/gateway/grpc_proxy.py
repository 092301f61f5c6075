"""gRPC proxy side: what Serve's gRPC proxy serves (``deltaserve.v1.Inference`` routed to the ingress
replicas, ``grpc.health.v1.Health`` answered by the proxy itself).

:func:`add_inference_servicer` goes into ``gRPCOptions.grpc_servicer_functions``
(``"deployments.gateway.grpc_proxy.add_inference_servicer"``). Serve calls it once in every
proxy actor with a mock servicer and its own ``grpc.aio`` server. It registers

- ``deltaserve.v1.Inference``: Serve rewrites these handlers so that each call is routed to
  the ingress deployment's method of the same name (``Generate``, ``GenerateStream``,
  ``ListModels``; :mod:`deployments.gateway.grpc_ingress`);
- ``grpc.health.v1.Health``: registered as a *passthrough* service, so the proxy answers it
  itself (SERVING for ``""`` and ``deltaserve.v1.Inference``) instead of routing it to a
  replica (which would need an ingress method called ``Check``).

Server reflection comes from Serve: ``gRPCOptions(enable_reflection=True)`` (the default) runs
after the servicer functions and advertises every service registered on the server, so it
lists ``deltaserve.v1.Inference`` and ``grpc.health.v1.Health``.

The listening address: Serve 2.60's ``gRPCOptions`` has a port and no host, and its proxy binds
``[::]:<port>`` (every interface, IPv4 and IPv6) in ``ray.serve._private.grpc_util.start_grpc_server``
through ``ray.serve._private.default_impl.add_grpc_address``, before any servicer function runs
(so :func:`add_inference_servicer` is too late to change it: the port is bound by then).
:func:`bind_grpc_to_host` moves it to ``$DELTASERVE_GRPC_HOST`` (default 127.0.0.1): it is
Serve's HTTP-proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``), which every proxy
actor calls in its constructor, before it starts the gRPC server; it replaces
``add_grpc_address`` in that process. ``deltaserve up`` sets both variables
(``deployments.cli.up.serve_env``); a cluster you start yourself needs them in its environment.

The same callback returns the HTTP proxy's one middleware, :class:`OpenAIProxyErrors`: the errors
Serve's HTTP proxy answers by itself, before any ingress replica runs (``max_queued_requests`` of
the ingress deployment reached: 503; no ingress replica: 503; Serve's own request timeout: 408),
are plain text in Serve 2.60 (``ray.serve._private.http_util.send_http_response_on_exception``;
``BackpressureConfig`` sets only their status and ``Retry-After``). The middleware wraps the proxy's
ASGI app (Serve applies a callback's middlewares around it, ``_apply_middlewares``) and rewrites such
a response into OpenAI's error object, with ``Retry-After`` on a 503/429. Serve's gRPC proxy has no
middleware option; its own rejections (RESOURCE_EXHAUSTED for back-pressure, UNAVAILABLE with no
replica) carry Serve's text and no trailers. :func:`add_inference_servicer` wraps the proxy server's
``service_handler_factory`` (the function Serve builds every routed handler from) so that such a
status leaves with this platform's details and the trailers the ingress's own errors carry
(``x-deltaserve-error-code``, ``retry-after``, ``x-deltaserve-request-id``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deployments.proto.deltaserve.v1 import inference_pb2 as pb
from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "deltaserve.v1.Inference"
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # "grpc.health.v1.Health"
GRPC_HOST_ENV = "DELTASERVE_GRPC_HOST"
PROXY_CALLBACK = "deployments.gateway.grpc_proxy.bind_grpc_to_host"  # for RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


log = logging.getLogger("ray.serve").getChild("deltaserve")

#: what a client reads for each of Serve's own errors (Serve's text names its internals)
_PROXY_MESSAGES = {
    "overloaded": "the platform is over capacity (the ingress's queue is full); retry later",
    "unavailable": "no ingress replica is available to serve this request; retry later",
    "timeout": "the request ran past the platform's HTTP request timeout",
    "rate_limited": "the platform is over capacity (the ingress's queue is full); retry later",
    "internal": "internal error in the platform's HTTP proxy",
}


def proxy_error(status: int, serve_text: str, request_id: str):
    """The :class:`~deployments.gateway.errors.ApiError` a client gets for Serve's own plain-text error
    ``status`` (its text ``serve_text`` is not shown: Serve's internals)."""
    from deployments.gateway import errors

    suffix = f" (request id {request_id})" if request_id else ""
    if status == 503:
        if "backpressure" in serve_text:
            return errors.Overloaded(_PROXY_MESSAGES["overloaded"] + suffix, retry_after_s=1.0)
        return errors.Unavailable(_PROXY_MESSAGES["unavailable"] + suffix, retry_after_s=2.0)
    if status == 429:
        err = errors.Overloaded(_PROXY_MESSAGES["rate_limited"] + suffix, retry_after_s=1.0)
        err.status = 429
        return err
    if status in (408, 504):
        err = errors.DeadlineExceeded(_PROXY_MESSAGES["timeout"] + suffix)
        err.status = status
        return err
    if status >= 500:
        err = errors.InternalError(_PROXY_MESSAGES["internal"] + suffix)
        err.status = status
        return err
    err = errors.NotFound(serve_text.strip()[:200] or "not found") if status == 404 else \
        errors.BadRequest(serve_text.strip()[:200] or "bad request")
    err.status = status
    return err


class OpenAIProxyErrors:
    """ASGI middleware for Serve's HTTP proxy: a plain-text error response (status >= 400, ``text/plain``:
    what Serve's proxy sends by itself; the ingress's own errors are JSON) becomes OpenAI's error object
    (``application/json``) with the same status, ``Retry-After`` (Serve's when it set one, else the error's)
    and ``x-deltaserve-request-id`` (Serve's request id). A request the proxy fails without answering
    gets a JSON 500. Serve's own endpoints (``/-/healthz``, ``/-/routes``) are left as they are."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http" or scope.get("path", "").startswith("/-/"):
            await self.app(scope, receive, send)
            return
        held: dict | None = None  # the start of a plain-text error, until its body is complete
        body: list[bytes] = []
        started = False

        async def rewrite(message) -> None:
            nonlocal held, started
            if message["type"] == "http.response.start":
                started = True
                headers = {k.lower(): v for k, v in message.get("headers", ())}
                ctype = headers.get(b"content-type", b"")
                if message["status"] >= 400 and (not ctype or ctype.startswith(b"text/plain")):
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                body.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                start, held = held, None
                await self._send_error(send, start, b"".join(body).decode("utf-8", "replace"))
                return
            await send(message)

        try:
            await self.app(scope, receive, rewrite)
        except Exception:
            if started:
                raise
            log.exception("Serve's HTTP proxy failed a request before answering it")
            await self._send_error(send, {"status": 500, "headers": []}, "")
            return
        if not started:
            await self._send_error(send, {"status": 500, "headers": []}, "")

    @staticmethod
    async def _send_error(send, start: dict, text: str) -> None:
        headers = {k.lower(): v for k, v in start.get("headers", ())}
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")
        err = proxy_error(start["status"], text, request_id)
        payload = json.dumps(err.error_body()).encode()
        out = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        retry = headers.get(b"retry-after") or (err.retry_after_header or "").encode()
        if retry:
            out.append((b"retry-after", retry))
        if request_id:
            out += [(b"x-request-id", request_id.encode()), (b"x-deltaserve-request-id", request_id.encode())]
        log.warning("Serve's HTTP proxy answered request %s with %d (%s): sent as %s", request_id or "?",
                    start["status"], text.strip()[:200], err.code)
        await send({"type": "http.response.start", "status": start["status"], "headers": out})
        await send({"type": "http.response.body", "body": payload})


def proxy_middlewares() -> list:
    """The HTTP proxy's middlewares (Starlette ``Middleware`` entries, as Serve's callback must return)."""
    from starlette.middleware import Middleware

    return [Middleware(OpenAIProxyErrors)]


def bind_grpc_to_host() -> list:
    """Serve's HTTP-proxy callback: make this proxy's gRPC server listen on ``$DELTASERVE_GRPC_HOST``
    (default 127.0.0.1) instead of every interface (see the module docstring), and return the HTTP
    proxy's middlewares (:func:`proxy_middlewares`). Raises if Serve no longer binds through
    ``add_grpc_address`` (another Ray version): the proxy then fails to start rather than listen on
    every interface unnoticed."""
    from ray.serve._private import default_impl

    host = os.environ.get(GRPC_HOST_ENV) or "127.0.0.1"
    serve_add = getattr(default_impl, "add_grpc_address", None)
    if serve_add is None:
        raise RuntimeError(f"ray.serve._private.default_impl.add_grpc_address is gone in this Ray version: "
                           f"cannot bind Serve's gRPC proxy to {host}")
    if getattr(serve_add, "deltaserve_host", None) is not None:
        return proxy_middlewares()

    def add_grpc_address(grpc_server: Any, server_address: str) -> None:
        port = int(server_address.rsplit(":", 1)[1])
        if grpc_server.add_insecure_port(grpc_address(host, port)) == 0:
            raise RuntimeError(f"Serve's gRPC proxy could not bind {grpc_address(host, port)}")

    add_grpc_address.deltaserve_host = host
    default_impl.add_grpc_address = add_grpc_address
    return proxy_middlewares()


class ProxyHealthServicer(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` answered by the gRPC proxy itself (asyncio server).

    Static: the proxy process is up and ``deltaserve.v1.Inference`` is registered on it,
    so both the server ("") and the service report SERVING. Whether a model pool has
    capacity is the business of the Inference calls (UNAVAILABLE), not of this probe.
    """

    def __init__(self, services: tuple[str, ...] = ("", SERVICE_NAME)) -> None:
        self._status = {name: health_pb2.HealthCheckResponse.SERVING for name in services}

    async def Check(self, request, context):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        # Statuses never change while the proxy lives: send the current one and hold the
        # stream open until the client goes away (or the server stops).
        status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        yield health_pb2.HealthCheckResponse(status=status)
        await asyncio.Event().wait()

    async def List(self, request, context):
        response = health_pb2.HealthListResponse()
        for name, status in self._status.items():
            response.statuses[name].status = status
        return response


MD_ERROR_CODE, MD_RETRY_AFTER, MD_REQUEST_ID = "x-deltaserve-error-code", "retry-after", "x-deltaserve-request-id"


def _shape_serve_status(context: Any) -> None:
    """A RESOURCE_EXHAUSTED / UNAVAILABLE that Serve's gRPC proxy set itself (no ``x-deltaserve-error-code``
    trailer: the ingress sets one on each of its errors) gets this platform's details and trailers."""
    code = context.code()
    name = getattr(code, "name", None)
    if name not in ("RESOURCE_EXHAUSTED", "UNAVAILABLE"):
        return
    trailers = list(context.trailing_metadata() or ())
    if any(k == MD_ERROR_CODE for k, _ in trailers):
        return
    request_id = next((v for k, v in trailers if k == "request_id"), "")
    err = proxy_error(503, "backpressure" if name == "RESOURCE_EXHAUSTED" else "", request_id)
    context.set_details(err.message)
    context.set_trailing_metadata([*trailers, (MD_ERROR_CODE, str(err.code)), (MD_RETRY_AFTER, err.retry_after_header),
                                   *([(MD_REQUEST_ID, request_id)] if request_id else [])])
    log.warning("Serve's gRPC proxy answered request %s with %s: sent as %s", request_id or "?", name, err.code)


def _shaping_factory(factory: Any) -> Any:
    """Serve's ``service_handler_factory``, its unary and server-streaming handlers followed by
    :func:`_shape_serve_status`."""

    def make(service_method: str, streaming_type: Any) -> Any:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        kind = getattr(streaming_type, "name", str(streaming_type))
        if kind == "UNARY_UNARY":
            async def unary_unary(request_proto: Any, context: Any) -> Any:
                response = await handler(request_proto, context)
                _shape_serve_status(context)
                return response

            return unary_unary
        if kind == "UNARY_STREAM":
            async def unary_stream(request_proto: Any, context: Any) -> Any:
                async for message in handler(request_proto, context):
                    yield message
                _shape_serve_status(context)

            return unary_stream
        return handler

    make.deltaserve_shaped = True
    return make


def add_inference_servicer(servicer: Any, server: Any) -> None:
    """Servicer function for Serve's ``gRPCOptions.grpc_servicer_functions``.

    ``servicer`` is whatever Serve passes (a Mock: Serve replaces the Inference handlers
    with its replica-routing ones); ``server`` is Serve's ``gRPCGenericServer``. On a plain
    ``grpc.aio`` server (no ``add_passthrough_service``) this registers ``servicer`` for
    Inference and the health service as they are. On Serve's server, the routed handlers it builds from
    then on report Serve's own rejections as this platform's errors (:func:`_shaping_factory`).
    """
    factory = getattr(server, "service_handler_factory", None)
    if factory is not None and not getattr(factory, "deltaserve_shaped", False):
        server.service_handler_factory = _shaping_factory(factory)
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    mark_passthrough = getattr(server, "add_passthrough_service", None)
    if mark_passthrough is not None:
        # Must precede the registration: handlers of a passthrough service are added
        # unmodified, so the proxy runs them instead of routing them to a replica.
        mark_passthrough(HEALTH_SERVICE_NAME)
    health_pb2_grpc.add_HealthServicer_to_server(ProxyHealthServicer(), server)
