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
"""

from __future__ import annotations

import asyncio
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


def bind_grpc_to_host() -> list:
    """Serve's HTTP-proxy callback: make this proxy's gRPC server listen on ``$DELTASERVE_GRPC_HOST``
    (default 127.0.0.1) instead of every interface (see the module docstring). Returns no middlewares.
    Raises if Serve no longer binds through ``add_grpc_address`` (another Ray version): the proxy then
    fails to start rather than listen on every interface unnoticed."""
    from ray.serve._private import default_impl

    host = os.environ.get(GRPC_HOST_ENV) or "127.0.0.1"
    serve_add = getattr(default_impl, "add_grpc_address", None)
    if serve_add is None:
        raise RuntimeError(f"ray.serve._private.default_impl.add_grpc_address is gone in this Ray version: "
                           f"cannot bind Serve's gRPC proxy to {host}")
    if getattr(serve_add, "deltaserve_host", None) is not None:
        return []

    def add_grpc_address(grpc_server: Any, server_address: str) -> None:
        port = int(server_address.rsplit(":", 1)[1])
        if grpc_server.add_insecure_port(grpc_address(host, port)) == 0:
            raise RuntimeError(f"Serve's gRPC proxy could not bind {grpc_address(host, port)}")

    add_grpc_address.deltaserve_host = host
    default_impl.add_grpc_address = add_grpc_address
    return []


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


def add_inference_servicer(servicer: Any, server: Any) -> None:
    """Servicer function for Serve's ``gRPCOptions.grpc_servicer_functions``.

    ``servicer`` is whatever Serve passes (a Mock: Serve replaces the Inference handlers
    with its replica-routing ones); ``server`` is Serve's ``gRPCGenericServer``. On a plain
    ``grpc.aio`` server (no ``add_passthrough_service``) this registers ``servicer`` for
    Inference and the health service as they are.
    """
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    mark_passthrough = getattr(server, "add_passthrough_service", None)
    if mark_passthrough is not None:
        # Must precede the registration: handlers of a passthrough service are added
        # unmodified, so the proxy runs them instead of routing them to a replica.
        mark_passthrough(HEALTH_SERVICE_NAME)
    health_pb2_grpc.add_HealthServicer_to_server(ProxyHealthServicer(), server)
