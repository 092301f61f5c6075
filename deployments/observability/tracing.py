"""OpenTelemetry tracing: one trace per request, one span per deployment hop, OTLP export from the
standard ``OTEL_*`` variables.

Spans of one request (all in one trace; names and attributes in ``docs/observability.md``, "Traces")::

    ingress          (ingress replica; SERVER; parent: the client's W3C ``traceparent``, if any)
    ├─ prefill       (a prefill replica; one per attempt: a failover runs prefill again)
    │  └─ expert-pool  (expert_mode "pool": the MoE layer calls this hop sent to the shards)
    └─ decode        (a decode replica, after that prefill)
       └─ expert-pool

Serve handles carry no headers, so the caller puts :func:`carrier_of`'s W3C carrier into the
payload (``PrefillRequest.trace``, ``DecodeRequest.trace``) and the callee starts its span under
it (:func:`span`, :func:`context_from`).

Each replica calls :func:`setup_tracing` once. Export is configured only by the standard
variables, read in every replica (a Ray cluster started by ``deltaserve up`` inherits its
environment; on Kubernetes the pods' env): ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` turns export on; ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``
picks ``grpc`` or ``http/protobuf`` (the OTLP default); ``OTEL_TRACES_EXPORTER=none`` or
``OTEL_SDK_DISABLED=true`` turn it off; the OpenTelemetry SDK itself reads the sampler
(``OTEL_TRACES_SAMPLER``/``_ARG``), the resource (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``), the batch processor (``OTEL_BSP_*``) and the exporter's headers,
timeout, compression and certificates. With ``memory=True`` finished spans are also kept in an
in-memory exporter that tests read back through the deployments' ``debug_spans`` method.

Errors: a failed request's ingress span has status ERROR and an ``exception`` event with what the
client was told (the public error class, its code and message: never a traceback or internal
text, see :func:`deployments.gateway.errors.public_error`); a failed prefill/decode hop's span has
status ERROR and an ``exception`` event with the exception's type and message, without a stack
trace. A hop cancelled by its caller (client gone, failover, deadline) is marked
``deltaserve.cancelled`` and keeps status UNSET.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract as _extract
from opentelemetry.propagate import inject as _inject
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

#: ``OTEL_EXPORTER_OTLP_PROTOCOL`` values this platform exports with (the spec's ``http/json`` is not
#: implemented by the Python exporters).
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "http/protobuf"  # the OTLP exporter spec's default
#: W3C trace-context fields taken from a client (HTTP headers, gRPC metadata); baggage is not, so a
#: client cannot add attributes to the platform's spans. Longer values are ignored (W3C limits:
#: traceparent is 55 characters, tracestate at most 32 list members of at most 256 + 1 each).
CLIENT_TRACE_FIELDS = {"traceparent": 55, "tracestate": 8192}
_MESSAGE_CHARS = 300  # an exception event's message is cut to this (span attributes are not logs)

_memory: InMemorySpanExporter | None = None
_configured = False


@dataclass(frozen=True, slots=True)
class OtlpExport:
    """Where spans go, as the standard variables say."""

    protocol: str  # one of PROTOCOLS
    endpoint: str  # the traces URL the exporter posts to (gRPC: the collector's address)

    def describe(self) -> str:
        return f"OTLP {self.protocol} to {self.endpoint}"


def otlp_export(env: Mapping[str, str] | None = None) -> OtlpExport | None:
    """The OTLP trace export ``env`` (default ``os.environ``) asks for; None when it asks for none.
    ValueError naming the variable and its value for a protocol or exporter this platform lacks."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    if exporter == "none":
        return None
    if exporter != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={exporter!r} is not supported: use 'otlp' (the default) or 'none'")
    traces_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not (traces_endpoint or base):
        return None
    var = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" if env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") else "OTEL_EXPORTER_OTLP_PROTOCOL"
    protocol = (env.get(var) or DEFAULT_PROTOCOL).strip().lower()
    if protocol not in PROTOCOLS:
        raise ValueError(f"{var}={protocol!r} is not supported: use one of {list(PROTOCOLS)}")
    if traces_endpoint:
        endpoint = traces_endpoint
    else:  # the spec: the signal's path is appended to the base URL for HTTP, not for gRPC
        endpoint = base if protocol == "grpc" else base.rstrip("/") + "/v1/traces"
    return OtlpExport(protocol, endpoint)


def _exporter(export: OtlpExport) -> SpanExporter:
    """The SDK's OTLP exporter; it reads headers, timeout, compression and certificates from the
    environment itself (and, for gRPC, ``insecure`` from an ``http://`` endpoint)."""
    if export.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=export.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=export.endpoint)


def _resource(service: str, instance: str | None, attributes: Mapping[str, Any]) -> Resource:
    """This process's identity over ``OTEL_RESOURCE_ATTRIBUTES`` (the SDK reads it; the spec gives code's
    attributes priority); ``service`` is only the default ``service.name``: ``OTEL_SERVICE_NAME`` or a
    ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES`` wins."""
    own = {"service.namespace": "deltaserve", "process.pid": os.getpid(), "host.name": socket.gethostname(),
           **{k: v for k, v in attributes.items() if v is not None}}
    if instance:
        own["service.instance.id"] = instance
    resource = Resource.create(own)
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):  # the SDK's fallback
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    return resource


def make_provider(service: str, *, memory: bool = False, instance: str | None = None,
                  attributes: Mapping[str, Any] | None = None) -> tuple[TracerProvider, InMemorySpanExporter | None]:
    """A tracer provider as the environment says (see :func:`setup_tracing`), and its in-memory
    exporter when ``memory``; not installed."""
    export = otlp_export()
    provider = TracerProvider(resource=_resource(service, instance, attributes or {}))  # sampler: OTEL_TRACES_SAMPLER
    if export is not None:
        provider.add_span_processor(BatchSpanProcessor(_exporter(export)))  # OTEL_BSP_* tune it
    kept = None
    if memory:
        kept = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(kept))
    return provider, kept


def setup_tracing(service: str, *, memory: bool = False, instance: str | None = None,
                  attributes: Mapping[str, Any] | None = None) -> None:
    """Install this process's tracer provider (idempotent): ``service`` is the default
    ``service.name``, ``instance`` the ``service.instance.id`` (the Serve replica id), ``attributes``
    more resource attributes (``deltaserve.component``, ``deltaserve.pool``); ``memory`` keeps
    finished spans for :func:`finished_spans`. ValueError for variables that ask for an export this
    platform lacks (see :func:`otlp_export`): the replica then fails to start, saying why.

    With no export and no ``memory`` it installs nothing: the API's default tracer then makes non-recording
    spans and empty carriers, so a request costs no span work that nobody would read (an SDK provider without
    a processor still built every span: about 0.1 ms of CPU per request across the ingress and its hops). A
    later call that asks for ``memory`` still installs its provider."""
    global _configured, _memory
    if _configured:
        return
    if otlp_export() is None and not memory:
        return
    provider, _memory = make_provider(service, memory=memory, instance=instance, attributes=attributes)
    trace.set_tracer_provider(provider)
    _configured = True


def tracer() -> trace.Tracer:
    return trace.get_tracer("deltaserve")


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}


# -- context -------------------------------------------------------------------------------
def inject() -> dict[str, str]:
    """W3C trace context of the current span, to put into a payload."""
    carrier: dict[str, str] = {}
    _inject(carrier)
    return carrier


def carrier_of(s: trace.Span) -> dict[str, str]:
    """W3C carrier naming ``s`` as the parent."""
    carrier: dict[str, str] = {}
    _inject(carrier, context=trace.set_span_in_context(s))
    return carrier


def context_from(carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context a payload's carrier names (for spans that outlive one `with` block)."""
    return _extract(carrier) if carrier else None


def client_carrier(fields: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> dict[str, str] | None:
    """The W3C ``traceparent``/``tracestate`` a client sent (HTTP headers or gRPC metadata pairs; keys
    case-insensitive), None without a traceparent. A malformed traceparent is dropped later by the
    propagator (the request then starts a new trace); an over-long value is dropped here."""
    if fields is None:
        return None
    pairs = fields.items() if isinstance(fields, Mapping) else fields
    out: dict[str, str] = {}
    for key, value in pairs:
        key = key.lower() if isinstance(key, str) else key
        limit = CLIENT_TRACE_FIELDS.get(key)
        if limit is not None and isinstance(value, str) and len(value) <= limit and key not in out:
            out[key] = value
    return out if "traceparent" in out else None


# -- spans of a hop ----------------------------------------------------------------------------
def fail(s: trace.Span, exc: BaseException) -> None:
    """Mark a hop's span failed by ``exc``: status ERROR, an ``exception`` event with its type and
    (cut) message, no stack trace."""
    message = str(exc)[:_MESSAGE_CHARS]
    s.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {message}"))
    s.add_event("exception", {"exception.type": type(exc).__name__, "exception.message": message})


def end_hop(s: trace.Span, exc: BaseException | None) -> None:
    """How a hop ended, on its span: failed (:func:`fail`), cancelled by its caller, or fine."""
    if isinstance(exc, Exception):
        fail(s, exc)
    elif exc is not None:  # CancelledError / GeneratorExit: the caller went away (client, failover, deadline)
        s.set_attribute("deltaserve.cancelled", True)


@contextmanager
def span(name: str, carrier: Mapping[str, str] | None = None, *, kind: SpanKind = SpanKind.SERVER,
         **attributes) -> Iterator[trace.Span]:
    """A hop's span under the context in ``carrier`` (or the current one), current inside the block;
    an exception leaving the block ends it as :func:`end_hop` says."""
    with tracer().start_as_current_span(name, context=context_from(carrier), kind=kind, attributes=_clean(attributes),
                                        record_exception=False, set_status_on_exception=False) as s:
        try:
            yield s
        except BaseException as e:
            end_hop(s, e)
            raise


def start_hop(name: str, carrier: Mapping[str, str] | None, **attributes) -> trace.Span:
    """A hop's span under ``carrier`` that the caller ends (one that spans an async generator's
    yields, where a current-context block cannot be held); end it with :func:`end_hop` on error."""
    return tracer().start_span(name, context=context_from(carrier), kind=SpanKind.SERVER, attributes=_clean(attributes))


def record_child(parent: trace.Span, name: str, start_ns: int, end_ns: int, **attributes) -> None:
    """A finished span under ``parent`` covering ``start_ns``..``end_ns`` (epoch nanoseconds): work
    measured as it happened and reported once (the expert pool's share of a request)."""
    s = tracer().start_span(name, context=trace.set_span_in_context(parent), kind=SpanKind.CLIENT, start_time=start_ns,
                            attributes=_clean(attributes))
    s.end(end_time=end_ns)


# -- the request's span ------------------------------------------------------------------------
def start_request(request_id: str, model: str, parent: Mapping[str, str] | None, **attributes) -> trace.Span:
    """The ingress span of one request, under the client's trace context ``parent`` (see
    :func:`client_carrier`) or a new trace."""
    return tracer().start_span("ingress", context=context_from(parent) or otel_context.Context(), kind=SpanKind.SERVER,
                               attributes=_clean({"deltaserve.request_id": request_id, "deltaserve.model": model,
                                                  **attributes}))


def request_attributes(record) -> dict[str, Any]:
    """The ``deltaserve.*`` attributes of a finished request, from its
    :class:`~deployments.gateway.frontend.RequestRecord` (fields not known stay unset)."""
    return _clean({
        "deltaserve.tenant": record.tenant or None, "deltaserve.pool": record.pool or None,
        "deltaserve.task_id": record.task_id, "deltaserve.code": record.code,
        "deltaserve.prompt_tokens": record.prompt_tokens, "deltaserve.cached_tokens": record.cached_tokens,
        "deltaserve.completion_tokens": record.completion_tokens, "deltaserve.ttft_s": record.ttft_s,
        "deltaserve.tpot_s": record.tpot_s, "deltaserve.e2e_s": record.e2e_s, "deltaserve.queue_s": record.queue_s,
        "deltaserve.failovers": record.failovers, "deltaserve.replayed_tokens": record.replayed_tokens,
    })


def end_request(s: trace.Span, record, exc: BaseException | None, request_id: str = "") -> None:
    """End a request's ingress span with ``record``'s attributes; a request that failed with ``exc``
    gets status ERROR and an ``exception`` event holding exactly what the client was told."""
    s.set_attributes(request_attributes(record))
    if exc is not None:
        from deployments.gateway.errors import public_error, status_of

        if status_of(exc) == 499:  # the client hung up: nobody was told anything
            kind, code, message = "ClientClosedRequest", "client_closed_request", "the client closed the request"
        else:
            err = public_error(exc, request_id)
            kind, code, message = type(err).__name__, str(err.code), err.message
        s.set_status(Status(StatusCode.ERROR, f"{record.code} {code}: {message}"[:_MESSAGE_CHARS]))
        s.add_event("exception", {"exception.type": kind, "exception.message": message, "deltaserve.error_code": code})
    s.end()


# -- tests -------------------------------------------------------------------------------------
def finished_spans() -> list[dict]:
    """Spans kept by the in-memory exporter, as plain dicts (for tests and timelines): ids, attributes,
    ``start_ns``/``end_ns`` (epoch nanoseconds: comparable across the replicas of one machine) and
    ``events`` as (name, epoch nanoseconds)."""
    if _memory is None:
        return []
    return [
        {
            "name": s.name,
            "trace_id": format(s.context.trace_id, "032x"),
            "span_id": format(s.context.span_id, "016x"),
            "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
            "attributes": dict(s.attributes or {}),
            "start_ns": s.start_time,
            "end_ns": s.end_time,
            "events": [(e.name, e.timestamp) for e in s.events],
        }
        for s in _memory.get_finished_spans()
    ]
