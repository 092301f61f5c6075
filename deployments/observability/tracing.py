"""OpenTelemetry tracing: one span per deployment hop, W3C context carried in request payloads.

Each replica calls :func:`setup_tracing` once. Export goes over OTLP when the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set; with ``memory=True``
finished spans are also kept in an in-memory exporter that tests read back through the
deployments' ``debug_spans`` method. Serve handles carry no headers, so the caller puts
``inject()``'s carrier into the payload and the callee starts its span under ``extract()``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract as _extract
from opentelemetry.propagate import inject as _inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_memory: InMemorySpanExporter | None = None
_configured = False


def setup_tracing(service: str, *, memory: bool = False) -> None:
    """Install a tracer provider for this process (idempotent)."""
    global _configured, _memory
    if _configured:
        return
    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if memory:
        _memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(_memory))
    trace.set_tracer_provider(provider)
    _configured = True


def tracer() -> trace.Tracer:
    return trace.get_tracer("deltaserve")


def inject() -> dict[str, str]:
    """W3C trace context of the current span, to put into a payload."""
    carrier: dict[str, str] = {}
    _inject(carrier)
    return carrier


@contextmanager
def span(name: str, carrier: dict[str, str] | None = None, **attributes) -> Iterator[trace.Span]:
    """A span under the context in ``carrier`` (or the current one)."""
    token = otel_context.attach(_extract(carrier)) if carrier else None
    try:
        with tracer().start_as_current_span(name, attributes={k: v for k, v in attributes.items() if v is not None}) as s:
            yield s
    finally:
        if token is not None:
            otel_context.detach(token)


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


def record_child(parent: trace.Span, name: str, start_ns: int, end_ns: int, **attributes) -> None:
    """A finished span under ``parent`` covering ``start_ns``..``end_ns`` (epoch nanoseconds): work
    measured as it happened and reported once (the expert pool's share of a request)."""
    s = tracer().start_span(name, context=trace.set_span_in_context(parent), start_time=start_ns,
                            attributes={k: v for k, v in attributes.items() if v is not None})
    s.end(end_time=end_ns)


def context_from(carrier: dict[str, str] | None) -> otel_context.Context | None:
    """The context a payload's carrier names (for spans that outlive one `with` block)."""
    return _extract(carrier) if carrier else None


def carrier_of(s: trace.Span) -> dict[str, str]:
    """W3C carrier naming ``s`` as the parent."""
    carrier: dict[str, str] = {}
    _inject(carrier, context=trace.set_span_in_context(s))
    return carrier
