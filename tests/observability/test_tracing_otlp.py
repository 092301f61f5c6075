"""Traces end to end: `deltaserve up` exporting OTLP/gRPC to a real receiver (the ``TraceService`` of
opentelemetry-proto on 127.0.0.1), configured only by the standard ``OTEL_*`` variables.

One platform run (expert_mode pool, two decode-standard replicas, the cache on) serves every check
of :func:`test_platform_traces`: one request is one trace whose ingress, prefill, decode and
expert-pool spans come from the replica processes under `deltaserve up`, linked parent to child;
a client's ``traceparent`` (HTTP header, gRPC metadata) becomes the ingress span's parent and an
unsampled one records nothing; the spans carry the numbers the response's ``usage`` shows; failed
requests (client errors, a deadline inside the platform) have status ERROR and the client's error
in their ``exception`` event; a decode replica killed mid-stream gives ``failover`` events. The
unit tests check what the variables select (protocol, endpoint, resource) against an OTLP/gRPC and
an OTLP/HTTP receiver in this process.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from deployments.config import PlatformConfig
from deployments.observability import tracing
from tests.deployments.platform_fixture import Platform, start_platform
from tests.deployments.up_process import run_up

STATUS_UNSET, STATUS_ERROR = 0, 2  # opentelemetry.proto.trace.v1.Status.StatusCode
KIND_SERVER = 2  # Span.SpanKind.SPAN_KIND_SERVER
#: the highspeed pool's end-to-end deadline in the traced platform: a long completion there is a 504
HIGHSPEED_DEADLINE_S = 1.0
ENVIRONMENT = "otlp-test"  # OTEL_RESOURCE_ATTRIBUTES deployment.environment.name


# -- the receiver ----------------------------------------------------------------------------
def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class Span:
    """One exported span, decoded from the OTLP request it came in."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    kind: int
    status: int
    status_message: str
    attributes: dict
    events: list[tuple[str, dict]]
    resource: dict
    start_ns: int
    end_ns: int

    @property
    def pid(self) -> int:
        return self.resource["process.pid"]

    def events_named(self, name: str) -> list[dict]:
        return [a for n, a in self.events if n == name]


def _decode(req: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    out = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind, s.status.code,
                                s.status.message, _attrs(s.attributes), [(e.name, _attrs(e.attributes)) for e in s.events],
                                resource, s.start_time_unix_nano, s.end_time_unix_nano))
    return out


class SpanSink:
    """Spans received so far, from any number of export requests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self.requests = 0

    def add(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = _decode(req)
        with self._lock:
            self._spans.extend(spans)
            self.requests += 1

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans() if s.trace_id == trace_id]

    def wait(self, predicate: Callable[[list[Span]], bool], what: str, timeout_s: float = 30) -> list[Span]:
        """All spans once ``predicate`` holds for them (the replicas export in batches)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not received within {timeout_s:.0f} s; got "
                                     f"{sorted((s.name, s.trace_id[:8]) for s in spans)}")
            time.sleep(0.1)

    def request_trace(self, request_id: str, names: dict[str, int], timeout_s: float = 30) -> dict[str, list[Span]]:
        """The trace of the request whose ingress span has ``request_id``, once it holds at least
        ``names`` (span name -> count); its spans by name."""
        def ready(spans: list[Span]) -> bool:
            root = _ingress(spans, request_id)
            if root is None:
                return False
            got = _by_name([s for s in spans if s.trace_id == root.trace_id])
            return all(len(got.get(n, ())) >= k for n, k in names.items())

        spans = self.wait(ready, f"trace of {request_id} with {names}", timeout_s)
        root = _ingress(spans, request_id)
        return _by_name([s for s in spans if s.trace_id == root.trace_id])


def _ingress(spans: list[Span], request_id: str) -> Span | None:
    return next((s for s in spans if s.name == "ingress" and s.attributes.get("deltaserve.request_id") == request_id), None)


def _by_name(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in sorted(spans, key=lambda s: s.start_ns):
        out.setdefault(s.name, []).append(s)
    return out


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on 127.0.0.1 (a free port)."""

    def __init__(self) -> None:
        self.sink = SpanSink()
        self.server = grpc.server(cf.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        self.sink.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None)


class HttpReceiver:
    """An OTLP/HTTP (protobuf) trace receiver on 127.0.0.1: POST /v1/traces."""

    def __init__(self) -> None:
        self.sink = SpanSink()
        self.paths: list[str] = []
        sink, paths = self.sink, self.paths

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                paths.append(self.path)
                sink.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- unit: what the variables select ---------------------------------------------------------------
OTEL_VARS = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME",
             "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")


@pytest.fixture
def otel_env(monkeypatch):
    for k in OTEL_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_otlp_export_reads_the_standard_variables():
    assert tracing.otlp_export({}) is None
    assert tracing.otlp_export({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == tracing.OtlpExport(
        "http/protobuf", "http://c:4318/v1/traces")  # the spec's default protocol; the signal path appended
    assert tracing.otlp_export({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == \
        tracing.OtlpExport("grpc", "http://c:4317")
    # the traces-specific variables win, and a traces endpoint is used as it is
    assert tracing.otlp_export({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/custom",
                                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) == \
        tracing.OtlpExport("http/protobuf", "http://t:9/custom")
    assert tracing.otlp_export({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing.otlp_export({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}) is None
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported"):
        tracing.otlp_export({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='thrift' is not supported"):
        tracing.otlp_export({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"})
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER='zipkin' is not supported"):
        tracing.otlp_export({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "zipkin"})


def test_client_carrier_takes_only_w3c_trace_context():
    tp = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    assert tracing.client_carrier({"TraceParent": tp, "TraceState": "k=v", "baggage": "tenant=evil"}) == \
        {"traceparent": tp, "tracestate": "k=v"}
    assert tracing.client_carrier([("traceparent", tp), ("authorization", "Bearer x")]) == {"traceparent": tp}
    assert tracing.client_carrier({"tracestate": "k=v"}) is None  # no traceparent: a new trace
    assert tracing.client_carrier({"traceparent": tp + "0"}) is None  # longer than W3C's 55 characters
    assert tracing.client_carrier(None) is None


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_protocol_variable_picks_the_exporter(otel_env, protocol):
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        otel_env.setenv("OTEL_RESOURCE_ATTRIBUTES", f"deployment.environment.name={ENVIRONMENT}")
        provider, _ = tracing.make_provider("deltaserve-test", instance="replica-1", attributes={"deltaserve.component": "t"})
        provider.get_tracer("t").start_span("one").end()
        assert provider.force_flush(10_000)
        provider.shutdown()
        (span,) = receiver.sink.spans()
        assert span.name == "one"
        assert span.resource["service.name"] == "deltaserve-test" and span.resource["service.instance.id"] == "replica-1"
        assert span.resource["process.pid"] == os.getpid() and span.resource["deltaserve.component"] == "t"
        assert span.resource["deployment.environment.name"] == ENVIRONMENT
        if protocol == "http/protobuf":
            assert receiver.paths == ["/v1/traces"]
    finally:
        receiver.stop()


def test_service_name_and_sampler_come_from_the_environment(otel_env):
    def service(**env) -> str:
        for k, v in env.items():
            otel_env.setenv(k, v)
        provider, kept = tracing.make_provider("default-name", memory=True)
        provider.get_tracer("t").start_span("s").end()
        names = [s.resource.attributes["service.name"] for s in kept.get_finished_spans()]
        provider.shutdown()
        return names[0] if names else ""

    assert service() == "default-name"
    assert service(OTEL_RESOURCE_ATTRIBUTES="service.name=from-attributes") == "from-attributes"
    assert service(OTEL_SERVICE_NAME="from-service-name") == "from-service-name"  # wins over both
    assert service(OTEL_TRACES_SAMPLER="always_off") == ""  # nothing sampled, nothing recorded


_NO_EXPORT_PROBE = """
import json
from deployments.observability import tracing
tp = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
tracing.setup_tracing("deltaserve-ingress")
own = tracing.start_request("r1", "k3-tiny", None)
child = tracing.start_request("r2", "k3-tiny", {"traceparent": tp})
hop = tracing.start_hop("prefill", tracing.carrier_of(own), **{"deltaserve.pool": "standard"})
out = {"recording": [s.is_recording() for s in (own, child, hop)], "own": tracing.carrier_of(own),
       "child": tracing.carrier_of(child)}
for s in (hop, own, child):
    s.end()
out["kept_before"] = len(tracing.finished_spans())
tracing.setup_tracing("deltaserve-ingress", memory=True)  # a later call that asks for memory still installs it
tracing.start_request("r3", "k3-tiny", None).end()
out["kept_after"] = [s["name"] for s in tracing.finished_spans()]
print(json.dumps(out))
"""


def test_without_an_export_no_span_is_recorded():
    """No OTLP export and no in-memory spans: no tracer provider is installed, so spans do not record and the
    payloads carry no trace context of the platform's own (a client's traceparent still passes through). A fresh
    interpreter: the tracer provider is process-wide and set once."""
    env = {k: v for k, v in os.environ.items() if k not in OTEL_VARS}
    done = subprocess.run([sys.executable, "-c", _NO_EXPORT_PROBE], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["recording"] == [False, False, False]
    assert out["own"] == {}
    assert out["child"] == {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    assert out["kept_before"] == 0 and out["kept_after"] == ["ingress"]


def test_deltaserve_up_refuses_an_unsupported_protocol(tmp_path):
    done = run_up(["--tenants", str(tmp_path / "tenants.yaml"), "--no-cache", "--no-prometheus"],
                  env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported" in done.stderr
    assert "starting Ray" not in done.stdout


# -- the platform -----------------------------------------------------------------------------
@dataclass
class Traced:
    platform: Platform
    sink: SpanSink
    pids: dict[str, list[int]] = field(default_factory=dict)  # Serve deployment -> its replicas' pids


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Iterator[Traced]:
    """`deltaserve up --expert-mode pool --replicas decode-standard=2` with the cache, exporting OTLP/gRPC
    to a receiver in this process (batches every 200 ms); the highspeed pool's deadline is
    :data:`HIGHSPEED_DEADLINE_S`. Standard sends every prompt through prefill (``local_prefill_tokens`` 0): these
    tests follow the ingress -> prefill -> decode chain (the local path's spans: tests/deployments/test_platform.py)."""
    workdir = tmp_path_factory.mktemp("traced")
    config = PlatformConfig().model_dump(mode="json")
    config["pools"]["highspeed"]["request_timeout_s"] = HIGHSPEED_DEADLINE_S
    config["pools"]["standard"]["local_prefill_tokens"] = 0
    (workdir / "platform.json").write_text(json.dumps(config))
    receiver = GrpcReceiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_RESOURCE_ATTRIBUTES": f"deployment.environment.name={ENVIRONMENT}"}
    try:
        with pytest.MonkeyPatch.context() as mp:  # start_platform passes this process's environment on
            for k in OTEL_VARS:
                mp.delenv(k, raising=False)
            for k, v in env.items():
                mp.setenv(k, v)
            stack = start_platform(workdir, "--config", str(workdir / "platform.json"), "--expert-mode", "pool",
                                   "--replicas", "decode-standard=2", "--no-prometheus", cache=True)
            platform = stack.__enter__()
        try:
            assert any(f"traces: OTLP grpc to {receiver.endpoint}" in ln for ln in platform.output), platform.output
            yield Traced(platform, receiver.sink, platform.replica_pids())
        finally:
            stack.__exit__(None, None, None)
    finally:
        receiver.stop()


def _complete(p: Platform, *, model: str = "k3-tiny", prompt: str, max_tokens: int, headers: dict | None = None,
              key: str | None = None, **extra) -> httpx.Response:
    return httpx.post(f"{p.http_url}/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {key or p.key}", **(headers or {})},
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, **extra})


def _traceparent(sampled: bool = True) -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


PROMPT = ("A trace follows one request through every replica it touches: the ingress that parsed it, the prefill "
          "replica that read the prompt, and the decode replica that streamed the answer back to the client. ") * 3


def _check_request_trace(t: Traced, r: httpx.Response, got: dict[str, list[Span]]) -> None:
    """One served request: its spans, processes, links and numbers against the response."""
    body = r.json()
    usage = body["usage"]
    (root,), (pre,), (dec,) = got["ingress"], got["prefill"], got["decode"]
    pool_spans = got["expert-pool"]
    # processes: the ingress, prefill-standard and decode-standard replicas under `deltaserve up`
    assert root.pid in t.pids["ingress"] and pre.pid in t.pids["prefill-standard"] and dec.pid in t.pids["decode-standard"]
    assert len({root.pid, pre.pid, dec.pid}) == 3
    assert [s.resource["service.name"] for s in (root, pre, dec)] == \
        ["deltaserve-ingress", "deltaserve-prefill-standard", "deltaserve-decode-standard"]
    assert all(s.resource["deployment.environment.name"] == ENVIRONMENT for s in (root, pre, dec, *pool_spans))
    assert pre.resource["service.instance.id"] == pre.attributes["deltaserve.replica"]
    assert dec.resource["service.instance.id"] == dec.attributes["deltaserve.replica"] == r.headers["x-deltaserve-replica"]
    # links: ingress -> prefill, ingress -> decode (after prefill), each hop -> its expert-pool span
    assert pre.parent_id == dec.parent_id == root.span_id
    assert sorted(s.parent_id for s in pool_spans) == sorted([pre.span_id, dec.span_id])
    assert root.start_ns <= pre.start_ns < pre.end_ns <= dec.start_ns < dec.end_ns <= root.end_ns
    assert root.kind == pre.kind == dec.kind == KIND_SERVER
    assert [s.status for s in (root, pre, dec, *pool_spans)] == [STATUS_UNSET] * (3 + len(pool_spans))
    for s in pool_spans:
        a = s.attributes
        assert s.pid in (pre.pid, dec.pid) and a["deltaserve.expert_pool.transport"] == "direct"
        assert a["deltaserve.expert_pool.shards"] == 2 and a["deltaserve.expert_pool.layer_calls"] > 0
    # numbers: the response's usage
    a = root.attributes
    assert (a["deltaserve.tenant"], a["deltaserve.pool"], a["deltaserve.model"], a["deltaserve.code"]) == \
        ("fuzz", "standard", "k3-tiny", 200)
    assert a["deltaserve.request_id"] == body["id"] == pre.attributes["deltaserve.request_id"]
    assert a["deltaserve.prompt_tokens"] == usage["prompt_tokens"] == pre.attributes["deltaserve.prompt_tokens"]
    assert a["deltaserve.completion_tokens"] == usage["completion_tokens"] == dec.attributes["deltaserve.completion_tokens"]
    assert a["deltaserve.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] == \
        pre.attributes["deltaserve.cached_tokens"]
    assert a["deltaserve.ttft_s"] == pytest.approx(usage["timings"]["time_to_first_token_s"], abs=1e-6)
    assert a["deltaserve.e2e_s"] == pytest.approx(usage["timings"]["end_to_end_s"], abs=1e-6)
    assert a["deltaserve.replica"] == r.headers["x-deltaserve-replica"] and a["deltaserve.failovers"] == 0
    assert pre.attributes["deltaserve.tenant"] == dec.attributes["deltaserve.tenant"] == "fuzz"
    assert pre.attributes["deltaserve.pool"] == dec.attributes["deltaserve.pool"] == "standard"


def test_one_request_is_one_trace_across_processes_with_the_response_numbers(traced):
    r = _complete(traced.platform, prompt=PROMPT, max_tokens=6)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a fresh cache
    names = {"ingress": 1, "prefill": 1, "decode": 1, "expert-pool": 2}
    got = traced.sink.request_trace(r.json()["id"], names)
    assert {n: len(v) for n, v in got.items()} == names
    assert got["ingress"][0].parent_id == ""  # no traceparent: a new trace
    _check_request_trace(traced, r, got)
    assert got["prefill"][0].attributes["deltaserve.cache_hit"] is False

    # the same prompt again: served from the cache (checkpoints written in the background)
    for _ in range(20):
        again = _complete(traced.platform, prompt=PROMPT, max_tokens=6)
        assert again.status_code == 200, again.text
        if again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
            break
        time.sleep(0.5)
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, "the repeated prompt never hit the cache"
    got = traced.sink.request_trace(again.json()["id"], names)
    _check_request_trace(traced, again, got)
    assert got["prefill"][0].attributes["deltaserve.cache_hit"] is True
    # every span the ingress exported belongs to a request's trace rooted at its `ingress` span: no second trace per
    # request from the web framework's own instrumentation (FastAPI's "POST /v1/completions" and its operation spans;
    # the first requests' would have been exported before this one's ingress span, from the same queue)
    ingress_spans = [sp for sp in traced.sink.spans() if sp.resource["service.name"] == "deltaserve-ingress"]
    roots = {sp.trace_id for sp in ingress_spans if sp.name == "ingress"}
    assert roots and not [(sp.name, sp.trace_id[:8]) for sp in ingress_spans if sp.trace_id not in roots]
    print(f"\ntrace of a cache hit: {cached} of {again.json()['usage']['prompt_tokens']} prompt tokens cached; spans "
          f"{sorted((s.name, s.pid) for v in got.values() for s in v)}")


def test_a_client_traceparent_is_the_parent_over_http_and_grpc(traced):
    from deployments.proto.deltaserve.v1 import inference_pb2 as pb
    from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pb_grpc

    p = traced.platform
    trace_id, parent, header = _traceparent()
    r = _complete(p, prompt="parented over HTTP", max_tokens=3, headers={"traceparent": header, "tracestate": "vendor=1"})
    assert r.status_code == 200, r.text
    got = traced.sink.request_trace(r.json()["id"], {"ingress": 1, "prefill": 1, "decode": 1})
    root = got["ingress"][0]
    assert (root.trace_id, root.parent_id) == (trace_id, parent)
    assert {s.trace_id for v in got.values() for s in v} == {trace_id}

    g_trace, g_parent, g_header = _traceparent()
    with grpc.insecure_channel(p.grpc_target) as channel:
        reply = pb_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(model="k3-tiny", prompt="parented over gRPC", max_tokens=3, temperature=0, ignore_eos=True),
            metadata=[("authorization", f"Bearer {p.key}"), ("traceparent", g_header)], timeout=120)
    got = traced.sink.request_trace(reply.request_id, {"ingress": 1, "prefill": 1, "decode": 1})
    root = got["ingress"][0]
    assert (root.trace_id, root.parent_id) == (g_trace, g_parent)
    assert root.attributes["deltaserve.completion_tokens"] == reply.usage.completion_tokens == 3

    # an unsampled parent (flags 00): no replica records the request (parent-based sampling, the default)
    u_trace, _, u_header = _traceparent(sampled=False)
    r = _complete(p, prompt="not sampled", max_tokens=3, headers={"traceparent": u_header})
    assert r.status_code == 200, r.text
    after = _complete(p, prompt="sampled after it", max_tokens=3)  # exported by the same replicas, later
    traced.sink.request_trace(after.json()["id"], {"ingress": 1, "prefill": 1, "decode": 1})
    assert traced.sink.trace(u_trace) == []


def _error_span(t: Traced, r: httpx.Response) -> Span:
    rid = r.headers["x-deltaserve-request-id"]
    (root,) = t.sink.request_trace(rid, {"ingress": 1})["ingress"]
    assert root.status == STATUS_ERROR
    (event,) = root.events_named("exception")
    error = r.json()["error"]
    assert event == {"exception.type": event["exception.type"], "exception.message": error["message"],
                     "deltaserve.error_code": error["code"]}  # what the client was told, no stack trace
    assert root.status_message == f"{r.status_code} {error['code']}: {error['message']}"[:300]
    assert root.attributes["deltaserve.code"] == r.status_code
    return root


def test_failed_requests_have_error_status_and_the_clients_error(traced):
    p = traced.platform
    r = _complete(p, prompt="no such key", max_tokens=3, key="ds-not-a-key")
    assert r.status_code == 401
    root = _error_span(traced, r)
    assert root.events_named("exception")[0]["exception.type"] == "AuthError"
    assert "deltaserve.tenant" not in root.attributes  # nobody was authenticated

    r = _complete(p, prompt="far too long", max_tokens=10**6)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    root = _error_span(traced, r)
    assert root.events_named("exception")[0]["exception.type"] == "BadRequestError"
    assert (root.attributes["deltaserve.tenant"], root.attributes["deltaserve.pool"]) == ("fuzz", "standard")
    time.sleep(1)  # the replicas' batches of the same moment are in: the request never reached one
    assert [s.name for s in traced.sink.trace(root.trace_id)] == ["ingress"]

    # inside the platform: past the highspeed pool's deadline
    r = _complete(p, model="k3-tiny-highspeed", prompt="a long answer", max_tokens=2000)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    root = _error_span(traced, r)
    assert root.events_named("exception")[0]["exception.type"] == "DeadlineExceeded"
    assert root.attributes["deltaserve.pool"] == "highspeed"
    assert root.attributes["deltaserve.e2e_s"] == pytest.approx(HIGHSPEED_DEADLINE_S, abs=0.5)
    # the hop running at the deadline was cancelled by the ingress: marked so, not an error of its own
    spans = traced.sink.wait(lambda spans: any(s.trace_id == root.trace_id and s.attributes.get("deltaserve.cancelled")
                                               for s in spans), "the cancelled hop of the 504")
    hops = [s for s in spans if s.trace_id == root.trace_id and s.name != "ingress"]
    assert [s.status for s in hops] == [STATUS_UNSET] * len(hops)


def _stream(p: Platform, header: str, max_tokens: int, started: threading.Semaphore) -> dict:
    """A streamed completion (its usage chunk); ``started`` is released at its first token."""
    usage, first = None, True
    with httpx.stream("POST", f"{p.http_url}/v1/completions", timeout=300,
                      headers={**p.auth, "traceparent": header},
                      json={"model": "k3-tiny", "prompt": f"stream {header[3:11]}", "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first:
                first = False
                started.release()
            usage = chunk.get("usage") or usage
    return usage


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _busiest(pids: list[int], window_s: float = 0.5) -> int:
    """The process that used the most CPU over ``window_s``: the decode replica holding streams (Serve's
    router may put all of them on one replica; killing an idle one would move nothing)."""
    before = {pid: _cpu_ticks(pid) for pid in pids}
    time.sleep(window_s)
    return max(pids, key=lambda pid: _cpu_ticks(pid) - before[pid])


def test_a_decode_replica_killed_mid_stream_gives_failover_events(traced):
    """Six streams over two decode-standard replicas; the busier replica is killed (SIGKILL) once every
    stream has its first token. The streams it held move to the other replica: their ingress span has one
    ``failover`` event per move, and a second prefill replays exactly the tokens delivered."""
    p, streams, max_tokens = traced.platform, 6, 160
    victims = p.replica_pids()["decode-standard"]
    assert len(victims) == 2, victims
    parents = [_traceparent() for _ in range(streams)]
    started = threading.Semaphore(0)
    with cf.ThreadPoolExecutor(streams) as ex:
        futures = [ex.submit(_stream, p, header, max_tokens, started) for _, _, header in parents]
        for _ in range(streams):
            assert started.acquire(timeout=120), "a stream never started"
        victim = _busiest(victims)
        os.kill(victim, signal.SIGKILL)
        usages = [f.result(timeout=300) for f in futures]
    assert [u["completion_tokens"] for u in usages] == [max_tokens] * streams  # the client saw one whole stream each

    moved = 0
    for (trace_id, _, _), usage in zip(parents, usages):
        def complete(spans, trace_id=trace_id):
            root = next((s for s in spans if s.trace_id == trace_id and s.name == "ingress"), None)
            if root is None:
                return False
            decodes = [s for s in spans if s.trace_id == trace_id and s.name == "decode"]
            return len(decodes) >= 1 and len([s for s in spans if s.trace_id == trace_id and s.name == "prefill"]) == \
                1 + root.attributes["deltaserve.failovers"]

        traced.sink.wait(complete, f"the spans of stream {trace_id}")
        got = _by_name(traced.sink.trace(trace_id))
        (root,) = got["ingress"]
        events = root.events_named("failover")
        assert root.status == STATUS_UNSET and root.attributes["deltaserve.failovers"] == len(events)
        assert root.attributes["deltaserve.completion_tokens"] == usage["completion_tokens"]
        assert len(got["prefill"]) == 1 + len(events)
        # each resumption replays what the client had when the stream moved
        assert [s.attributes["deltaserve.replayed_tokens"] for s in got["prefill"][1:]] == \
            [e["deltaserve.delivered_tokens"] for e in events]
        assert [e["deltaserve.attempt"] for e in events] == list(range(1, len(events) + 1))
        if events:  # finished on the replica that lived; the killed one never ended (exported) its span
            moved += 1
            assert all(e["deltaserve.delivered_tokens"] >= 1 for e in events)
            assert [s.pid for s in got["decode"]] == [got["decode"][-1].pid] and got["decode"][-1].pid != victim
    print(f"\nfailover: {moved} of {streams} streams moved off the killed decode replica (pid {victim})")
    assert moved >= 1, "no stream was on the killed replica"


# -- the collector config --------------------------------------------------------------------------
COLLECTOR = Path(__file__).resolve().parents[2] / "ops" / "otel" / "collector.yaml"
#: The settings each component type of ops/otel/collector.yaml may have (a subset of the collector's
#: own config structs, enough to catch a misspelled key): what can be checked without an otelcol binary.
COMPONENT_KEYS = {
    ("extensions", "health_check"): {"endpoint", "path", "check_collector_pipeline", "tls"},
    ("receivers", "otlp"): {"protocols"},
    ("processors", "memory_limiter"): {"check_interval", "limit_mib", "spike_limit_mib", "limit_percentage",
                                       "spike_limit_percentage"},
    ("processors", "batch"): {"send_batch_size", "send_batch_max_size", "timeout", "metadata_keys"},
    ("exporters", "otlp"): {"endpoint", "tls", "headers", "compression", "timeout", "sending_queue", "retry_on_failure",
                            "balancer_name", "auth"},
}


def _component_type(name: str) -> str:
    return name.split("/", 1)[0]  # "otlp/tempo" is an "otlp" named "tempo"


def test_collector_config_defines_every_pipeline_component():
    """ops/otel/collector.yaml: OTLP gRPC + HTTP in on 0.0.0.0 (its own pod) -> memory_limiter -> batch ->
    Tempo's OTLP/gRPC, plus the health_check extension. No otelcol binary is installed here (nor
    packaged for Debian or PyPI), so this checks the YAML's shape: every component a pipeline or
    ``service.extensions`` names is defined, each defined one is used, its keys are ones the
    collector knows, and the values the platform and the Kubernetes base rely on."""
    config = yaml.safe_load(COLLECTOR.read_text())
    service = config["service"]
    used = {("extensions", e) for e in service["extensions"]}
    for name, pipeline in service["pipelines"].items():
        assert _component_type(name) in ("traces", "metrics", "logs"), name
        for section in ("receivers", "processors", "exporters"):
            assert pipeline[section], f"pipeline {name} has no {section}"
            used |= {(section, c) for c in pipeline[section]}
    defined = {(section, c) for section in ("extensions", "receivers", "processors", "exporters")
               for c in config.get(section) or {}}
    assert used == defined, f"named but not defined: {used - defined}; defined but unused: {defined - used}"
    for section, name in defined:
        settings = config[section][name] or {}
        allowed = COMPONENT_KEYS[(section, _component_type(name))]
        assert set(settings) <= allowed, f"{section}.{name}: unknown keys {set(settings) - allowed}"

    traces = service["pipelines"]["traces"]
    assert traces == {"receivers": ["otlp"], "processors": ["memory_limiter", "batch"], "exporters": ["otlp/tempo"]}
    assert config["receivers"]["otlp"]["protocols"] == {"grpc": {"endpoint": "0.0.0.0:4317"},
                                                         "http": {"endpoint": "0.0.0.0:4318"}}
    limiter = config["processors"]["memory_limiter"]
    assert 0 < limiter["spike_limit_mib"] < limiter["limit_mib"]
    tempo = config["exporters"]["otlp/tempo"]
    assert tempo["endpoint"] == "${env:TEMPO_OTLP_ENDPOINT:-tempo:4317}" and tempo["tls"] == {"insecure": True}
    assert config["extensions"]["health_check"]["endpoint"] == "0.0.0.0:13133"


def test_collector_config_passes_otelcol_validate_where_installed():
    binary = shutil.which("otelcol-contrib") or shutil.which("otelcol")
    if binary is None:
        pytest.skip("no otelcol binary on this machine (the shape is checked by the test above)")
    done = subprocess.run([binary, "validate", f"--config={COLLECTOR}"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
