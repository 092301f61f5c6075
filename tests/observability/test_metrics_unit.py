"""The metrics' recording paths against the in-process registry (no Ray): exact values.

- :class:`RequestMetrics` for a scripted set of RequestRecords (served, failed before auth, failed
  after, failed over; SLO met and missed at the boundaries);
- the engine's per-step stats (:attr:`Engine.on_step`) for a scripted run of the tiny model, and what
  :class:`ReplicaMetrics` makes of them and of the cache's counters;
- the whole request path in-process (Frontend → real Prefill/Decode replicas → RequestMetrics): the
  counters equal the responses' usage, and refusals carry their codes and limits.
"""

from __future__ import annotations

import asyncio

import pytest

from deployments.config import PlatformConfig
from deployments.engine import Engine, EngineConfig, GenerationRequest, StepStats
from deployments.gateway.errors import ApiError, status_of
from deployments.gateway.frontend import Frontend, RequestRecord
from deployments.gateway.protocol import CompletionInput, Finished
from deployments.observability import metrics
from deployments.observability.replica_metrics import ReplicaMetrics
from deployments.observability.request_metrics import UNKNOWN, RequestMetrics, SloTargets
from deployments.tenancy import RateLimiter, TenantRegistry
from deployments.workers.decode import Decode
from deployments.workers.local import LocalBackend
from deployments.workers.prefill import Prefill
from deployments.workers.replica import make_cache
from model import load_model, load_tokenizer
from model.runner import ModelRunner


@pytest.fixture(autouse=True)
def fresh_registry():
    metrics.reset()
    metrics.set_enabled(True)
    yield
    metrics.reset()
    metrics.set_enabled(True)


def values(name: str, **labels: str) -> list[float]:
    """What the in-process registry holds for ``name`` with exactly ``labels`` ([] when nothing)."""
    return metrics.snapshot().get((name, tuple(sorted(labels.items()))), [])


def series(name: str) -> dict[tuple[tuple[str, str], ...], list[float]]:
    return {labels: v for (n, labels), v in metrics.snapshot().items() if n == name}


# -- RequestMetrics -----------------------------------------------------------------------------
TARGETS = {"standard": SloTargets(ttft_s=4.0, tpot_s=0.4), "highspeed": SloTargets(ttft_s=1.0, tpot_s=0.1)}
STD = {"pool": "standard", "model": "m", "tenant": "alice"}
HS = {"pool": "highspeed", "model": "m-highspeed", "tenant": "alice"}


def served(rid: str, pool: str, *, ttft: float, tpot: float | None, prompt=10, cached=0, out=5, e2e=2.0, queue=0.01,
           failovers=0, replayed=0) -> RequestRecord:
    return RequestRecord(rid, tenant="alice", pool=pool, model="m" if pool == "standard" else "m-highspeed", code=200,
                         prompt_tokens=prompt, cached_tokens=cached, completion_tokens=out, ttft_s=ttft, tpot_s=tpot,
                         e2e_s=e2e, queue_s=queue, failovers=failovers, replayed_tokens=replayed)


SCRIPT = [
    served("a", "standard", ttft=4.0, tpot=0.4, prompt=10, cached=4, out=5),  # both exactly at the target: met
    served("b", "standard", ttft=4.000001, tpot=0.1, prompt=20, out=7),  # TTFT just over: missed
    served("c", "standard", ttft=0.5, tpot=0.400001, prompt=3, out=9, failovers=1, replayed=4),  # TPOT just over
    served("d", "standard", ttft=0.2, tpot=None, prompt=8, out=1),  # one token: no TPOT, "both" is the TTFT's
    served("e", "highspeed", ttft=1.0, tpot=0.1, prompt=30, cached=16, out=4),  # at both targets
    served("f", "highspeed", ttft=1.5, tpot=0.05, prompt=6, out=2),  # TTFT missed
    RequestRecord("g", model="whatever a client sent", code=401, e2e_s=0.001),  # bad key: nothing known
    RequestRecord("h", tenant="alice", model="nope", code=404, e2e_s=0.001),  # unknown model: tenant known
    RequestRecord("i", tenant="alice", pool="standard", model="m", code=429, e2e_s=0.001),  # rate limited
    # failed over twice, then failed: counted in failovers, not served
    RequestRecord("j", tenant="alice", pool="standard", model="m", code=503, prompt_tokens=12, completion_tokens=3,
                  ttft_s=0.3, e2e_s=9.0, queue_s=0.02, failovers=2, replayed_tokens=6),
]


def test_request_metrics_record_exactly_the_scripted_requests():
    obs = RequestMetrics(TARGETS)
    for record in SCRIPT:
        obs.request_done(record)
    ok = {"status": "ok", "code": "200"}
    assert series("deltaserve_requests_total") == {
        tuple(sorted({**STD, **ok}.items())): [4.0],
        tuple(sorted({**HS, **ok}.items())): [2.0],
        tuple(sorted({"pool": UNKNOWN, "model": UNKNOWN, "tenant": UNKNOWN, "status": "error", "code": "401"}.items())): [1.0],
        tuple(sorted({"pool": UNKNOWN, "model": UNKNOWN, "tenant": "alice", "status": "error", "code": "404"}.items())): [1.0],
        tuple(sorted({**STD, "status": "error", "code": "429"}.items())): [1.0],
        tuple(sorted({**STD, "status": "error", "code": "503"}.items())): [1.0],
    }
    # only served requests in the latency histograms and token counters
    assert values("deltaserve_ttft_seconds", **STD) == [4.0, 4.000001, 0.5, 0.2]
    assert values("deltaserve_ttft_seconds", **HS) == [1.0, 1.5]
    assert values("deltaserve_tpot_seconds", **STD) == [0.4, 0.1, 0.400001]
    assert values("deltaserve_e2e_seconds", **HS) == [2.0, 2.0]
    assert values("deltaserve_queue_seconds", **STD) == [0.01, 0.01, 0.01, 0.01, 0.02]  # the failed one reached prefill
    assert values("deltaserve_prompt_tokens_total", **STD) == [41.0]
    assert values("deltaserve_cached_prompt_tokens_total", **STD) == [4.0]
    assert values("deltaserve_generation_tokens_total", **STD) == [22.0]
    assert values("deltaserve_prompt_tokens_total", **HS) == [36.0]
    assert values("deltaserve_cached_prompt_tokens_total", **HS) == [16.0]
    assert values("deltaserve_generation_tokens_total", **HS) == [6.0]
    assert values("deltaserve_failovers_total", pool="standard", model="m") == [3.0]
    assert values("deltaserve_replayed_tokens_total", pool="standard", model="m") == [10.0]
    slo = {dict(k)["target"] + ":" + dict(k)["result"] + ":" + dict(k)["pool"]: v for k, v in series("deltaserve_slo_total").items()}
    assert slo == {
        "ttft:met:standard": [3.0], "ttft:missed:standard": [1.0],  # a (at the target), c, d met; b missed
        "tpot:met:standard": [2.0], "tpot:missed:standard": [1.0],  # a (at the target), b met; c missed; d has none
        "both:met:standard": [2.0], "both:missed:standard": [2.0],  # a, d met; b, c missed
        "ttft:met:highspeed": [1.0], "ttft:missed:highspeed": [1.0],
        "tpot:met:highspeed": [2.0],
        "both:met:highspeed": [1.0], "both:missed:highspeed": [1.0],
    }


def test_slo_targets_are_histogram_buckets():
    RequestMetrics({"standard": SloTargets(2.5, 0.25), "highspeed": SloTargets(0.3, 0.07)})
    assert {2.5, 0.3} <= set(metrics.buckets("deltaserve_ttft_seconds"))
    assert {0.25, 0.07} <= set(metrics.buckets("deltaserve_tpot_seconds"))
    assert list(metrics.buckets("deltaserve_ttft_seconds")) == sorted(metrics.buckets("deltaserve_ttft_seconds"))
    with pytest.raises(ValueError, match="deltaserve_requests_total"):
        metrics.add_buckets("deltaserve_requests_total", [1.0])
    with pytest.raises(ValueError, match="SLO targets must be > 0"):
        SloTargets(0.0, 1.0)


def test_disabled_records_nothing_and_labels_are_checked():
    metrics.set_enabled(False)
    RequestMetrics(TARGETS).request_done(SCRIPT[0])
    metrics.bind("deltaserve_step_seconds", pool="standard", kind="decode", step="decode").observe(0.1)
    assert metrics.snapshot() == {}
    metrics.set_enabled(True)
    with pytest.raises(ValueError, match=r"deltaserve_step_seconds takes labels \('pool', 'kind', 'step'\)"):
        metrics.bind("deltaserve_step_seconds", pool="standard", kind="decode")
    with pytest.raises(KeyError, match="deltaserve_nope"):
        metrics.bind("deltaserve_nope")
