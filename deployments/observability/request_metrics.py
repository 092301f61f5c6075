"""Per-request metrics: a :class:`~deployments.gateway.frontend.RequestObserver` the ingress hands every
finished request to (served or failed).

What one :class:`~deployments.gateway.frontend.RequestRecord` records (catalog names, see
:mod:`deployments.observability.metrics`; labels ``pool``, ``model``, ``tenant``):

- every request: ``deltaserve_requests_total{status=ok|error, code}``; ``deltaserve_queue_seconds``
  when it reached a prefill replica; ``deltaserve_failovers_total`` and
  ``deltaserve_replayed_tokens_total`` by its failovers (a request may fail over and still fail);
- a served request (``code < 400``): ``deltaserve_ttft_seconds``, ``deltaserve_e2e_seconds``,
  ``deltaserve_tpot_seconds`` (only with at least 2 output tokens per choice: ``tpot_s`` is set),
  its prompt, cached-prompt and generated tokens, and ``deltaserve_slo_total`` against its pool's
  targets: ``target="ttft"`` (``ttft_s <= ttft_slo``), ``target="tpot"`` (only when ``tpot_s`` is set:
  ``tpot_s <= tpot_slo``) and ``target="both"`` (the TTFT target met, and the TPOT one when it
  applies). A value equal to its target meets it.

A request that failed before its tenant and pool were known (a bad API key, an unknown model) is
labelled ``tenant``/``pool``/``model`` = :data:`UNKNOWN`: the model id a client sent is not a
bounded label value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from deployments.observability import metrics

UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class SloTargets:
    """One pool's targets, seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be > 0 seconds, got ttft_s={self.ttft_s!r}, tpot_s={self.tpot_s!r}")


class RequestMetrics:
    """Records each finished request's metrics (see the module docstring). ``targets``: each pool's
    SLO targets; they become bucket boundaries of the TTFT and TPOT histograms, so the share of requests
    within a target is a bucket of the histogram. Construct it before the first request is recorded in
    the process (Ray fixes a histogram's buckets when it is created)."""

    def __init__(self, targets: Mapping[str, SloTargets]) -> None:
        self.targets = dict(targets)
        metrics.add_buckets("deltaserve_ttft_seconds", [t.ttft_s for t in self.targets.values()])
        metrics.add_buckets("deltaserve_tpot_seconds", [t.tpot_s for t in self.targets.values()])

    @classmethod
    def from_config(cls, config) -> RequestMetrics:
        """Targets from a :class:`~deployments.config.PlatformConfig`'s pools (``ttft_slo_ms``, ``tpot_slo_ms``)."""
        return cls({pool: SloTargets(pc.ttft_slo_ms / 1e3, pc.tpot_slo_ms / 1e3) for pool, pc in config.pools.items()})

    def request_done(self, record) -> None:
        known = bool(record.pool)
        pool = record.pool if known else UNKNOWN
        labels = {"pool": pool, "model": record.model if known else UNKNOWN, "tenant": record.tenant or UNKNOWN}
        metrics.inc("deltaserve_requests_total", status="ok" if record.ok else "error", code=str(record.code), **labels)
        if record.queue_s is not None:
            metrics.observe("deltaserve_queue_seconds", record.queue_s, **labels)
        if record.failovers:
            metrics.inc("deltaserve_failovers_total", record.failovers, pool=pool, model=labels["model"])
            metrics.inc("deltaserve_replayed_tokens_total", record.replayed_tokens, pool=pool, model=labels["model"])
        if not record.ok:
            return
        metrics.inc("deltaserve_prompt_tokens_total", record.prompt_tokens, **labels)
        metrics.inc("deltaserve_cached_prompt_tokens_total", record.cached_tokens, **labels)
        metrics.inc("deltaserve_generation_tokens_total", record.completion_tokens, **labels)
        metrics.observe("deltaserve_e2e_seconds", record.e2e_s, **labels)
        if record.ttft_s is not None:
            metrics.observe("deltaserve_ttft_seconds", record.ttft_s, **labels)
        if record.tpot_s is not None:
            metrics.observe("deltaserve_tpot_seconds", record.tpot_s, **labels)
        self._slo(record, labels)

    def _slo(self, record, labels: dict[str, str]) -> None:
        target = self.targets.get(record.pool)
        if target is None or record.ttft_s is None:
            return
        ttft_met = record.ttft_s <= target.ttft_s
        metrics.inc("deltaserve_slo_total", target="ttft", result=_result(ttft_met), **labels)
        tpot_met = True
        if record.tpot_s is not None:
            tpot_met = record.tpot_s <= target.tpot_s
            metrics.inc("deltaserve_slo_total", target="tpot", result=_result(tpot_met), **labels)
        metrics.inc("deltaserve_slo_total", target="both", result=_result(ttft_met and tpot_met), **labels)


def _result(met: bool) -> str:
    return "met" if met else "missed"
