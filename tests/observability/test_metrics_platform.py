"""The metrics agree with the requests: one `deltaserve up` (embedded Prometheus scraping Ray's metrics
export port), load on both pools (streamed and not, a few bad requests, a tenant over its limit), a
decode replica killed mid-stream, then PromQL against that Prometheus:

- TTFT histogram ``_count`` per pool == the requests each pool served;
- prompt, cached-prompt and generated token counters per pool == the sums of the responses' ``usage``;
- requests by code == the codes the client got; rate-limit refusals == the 429s;
- the failover counter == the failovers the ingress counted (``Ingress.failovers``) for the streams cut by
  the kill;
- cost per pool == the hand computation from the price table and the usage tokens;
- the series carry Serve's ``deployment``/``replica``/``application`` labels, and the per-replica
  engine metrics exist for each prefill and decode deployment.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deployments.config import PlatformConfig
from deployments.tenancy import TenantRegistry
from tests.deployments.up_process import deltaserve_up

MODELS = {"standard": "k3-tiny", "highspeed": "k3-tiny-highspeed"}


class Client:
    """Sends requests and keeps what the client saw: codes, and per pool the served requests' usage."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.codes: collections.Counter[int] = collections.Counter()
        self.usage: dict[str, list[dict]] = {pool: [] for pool in MODELS}
        self.lock = threading.Lock()

    def complete(self, key: str, body: dict, *, on_chunk=None) -> int:
        """One completion; its status. ``on_chunk(i)``: called with each streamed event's index."""
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=300) as http:
            if not body.get("stream"):
                r = http.post("/v1/completions", json=body)
                usage, pool = (r.json()["usage"], r.headers["x-deltaserve-pool"]) if r.status_code == 200 else (None, None)
                return self._saw(r.status_code, pool, usage)
            body = {**body, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return self._saw(r.status_code, None, None)
                usage = pool = None
                chunks = 0
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, f"stream failed after its first byte: {event}"
                    if on_chunk is not None:
                        on_chunk(chunks)
                    chunks += 1
                    pool = event.get("deltaserve", {}).get("pool", pool)
                    usage = event.get("usage", usage)
                return self._saw(200, pool, usage)

    def _saw(self, code: int, pool: str | None, usage: dict | None) -> int:
        with self.lock:
            self.codes[code] += 1
            if code == 200:
                self.usage[pool].append(usage)
        return code


class Prometheus:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/api/v1/query"

    def by(self, label: str, expr: str) -> dict[str, float]:
        """``sum by (label) (expr)``: {label value: value}."""
        r = httpx.get(self.url, params={"query": f"sum by ({label}) ({expr})"}, timeout=30)
        r.raise_for_status()
        return {s["metric"].get(label, ""): float(s["value"][1]) for s in r.json()["data"]["result"]}

    def total(self, expr: str) -> float:
        return sum(self.by("__none__", expr).values())

    def series(self, expr: str) -> list[dict[str, str]]:
        r = httpx.get(self.url, params={"query": expr}, timeout=30)
        r.raise_for_status()
        return [s["metric"] for s in r.json()["data"]["result"]]


def decode_replica_pids(up, pool: str) -> list[int]:
    """Pids of the running ``decode-<pool>`` Serve replicas under `deltaserve up` (by process title)."""
    out = []
    for pid in up.descendants():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ServeReplica" in cmd and f":decode-{pool}".encode() in cmd:
            out.append(pid)
    return out


def ingress_failovers(up) -> int:
    """Streams the ingress resumed on another replica (``Ingress.failovers``, its own count), asked through a
    driver of `deltaserve up`'s Ray cluster in a subprocess (its GCS address and auth token from /proc)."""
    gcs = None
    for pid in up.descendants():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        gcs = next((a.split("=", 1)[1] for a in args if a.startswith("--gcs-address=")), gcs)
    assert gcs, "no Ray process with --gcs-address under deltaserve up"
    environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{up.proc.pid}/environ").read_bytes().decode().split("\0")
                   if "=" in kv)
    code = ("import ray; from ray import serve; ray.init(address=%r, log_to_driver=False); "
            "print(serve.get_deployment_handle('ingress', app_name='deltaserve').failovers.remote().result(timeout_s=60))"
            % gcs)
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics-platform")
    reg = TenantRegistry()
    _, alice = reg.add("alice", pools=["standard", "highspeed"], rpm=100_000, tpm=100_000_000, max_context=4096)
    _, bob = reg.add("bob", pools=["standard"], rpm=2, tpm=100_000_000, max_context=4096)
    reg.save(tmp / "tenants.yaml")
    with deltaserve_up(["--tenants", str(tmp / "tenants.yaml"), "--replicas", "decode-standard=2"],
                       prometheus=True) as up:
        yield up, {"alice": alice, "bob": bob}


def wait_for(prom: Prometheus, expr: str, want: float, timeout_s: float = 90) -> None:
    """Until Prometheus's ``sum(expr)`` is ``want`` (Ray exports every few seconds, Prometheus scrapes every few more)."""
    deadline, got = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        got = prom.total(expr)
        if got == want:
            return
        time.sleep(1)
    raise AssertionError(f"sum({expr}) is {got} after {timeout_s:.0f} s, want {want}")


def test_metrics_agree_with_the_requests(platform):
    up, keys = platform
    client = Client(f"http://127.0.0.1:{up.http_port}")
    alice, bob = keys["alice"], keys["bob"]
    sent = 0

    def send(key: str, body: dict, want: int) -> None:
        nonlocal sent
        sent += 1
        assert client.complete(key, body) == want, body

    for pool, model in MODELS.items():  # served: streamed and not, a shared prefix (cache hits), n=2
        for i, (stream, max_tokens) in enumerate([(False, 4), (True, 9), (False, 1), (True, 16)]):
            send(alice, {"model": model, "prompt": f"The quick brown fox {i} jumps over the lazy dog. " * 6,
                         "max_tokens": max_tokens, "temperature": 0, "stream": stream, "ignore_eos": True}, 200)
        send(alice, {"model": model, "prompt": "Two choices", "max_tokens": 3, "n": 2, "temperature": 0,
                     "ignore_eos": True}, 200)
    send("ds-not-a-key", {"model": "k3-tiny", "prompt": "hi", "max_tokens": 2}, 401)
    send(alice, {"model": "no-such-model", "prompt": "hi", "max_tokens": 2}, 404)
    send(alice, {"model": "k3-tiny", "prompt": "hi", "max_tokens": 100_000}, 400)  # past the tenant's context
    send(bob, {"model": "k3-tiny-highspeed", "prompt": "hi", "max_tokens": 2}, 403)
    for want in (200, 200, 429):  # bob may send 2 requests a minute
        send(bob, {"model": "k3-tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}, want)

    # streams on both decode-standard replicas (Serve routes to the less loaded of two); one replica is killed
    # once every stream is decoding (its third chunk: the first is prefill's)
    victims = decode_replica_pids(up, "standard")
    assert len(victims) == 2, f"want 2 decode-standard replicas, found pids {victims}"
    streams, decoding = 6, threading.Semaphore(0)
    threads = [threading.Thread(target=client.complete, args=(alice, {
        "model": "k3-tiny", "prompt": f"Stream {i}: once upon a time", "max_tokens": 400, "temperature": 0,
        "stream": True, "ignore_eos": True}), kwargs={"on_chunk": lambda i: i == 2 and decoding.release()})
        for i in range(streams)]
    for t in threads:
        t.start()
    for _ in range(streams):
        assert decoding.acquire(timeout=120), "a stream is not decoding after 120 s"
    os.kill(victims[0], signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    sent += streams
    assert client.codes == {200: 10 + 2 + streams, 401: 1, 404: 1, 400: 1, 403: 1, 429: 1}, client.codes

    prom = Prometheus(up.prometheus_port)
    wait_for(prom, "ray_deltaserve_requests_total", sent)
    served = {pool: len(u) for pool, u in client.usage.items()}
    assert prom.by("pool", "ray_deltaserve_ttft_seconds_count") == {p: float(n) for p, n in served.items()}
    assert prom.by("pool", "ray_deltaserve_e2e_seconds_count") == {p: float(n) for p, n in served.items()}
    for metric, field in (("prompt_tokens", lambda u: u["prompt_tokens"]),
                          ("cached_prompt_tokens", lambda u: u["prompt_tokens_details"]["cached_tokens"]),
                          ("generation_tokens", lambda u: u["completion_tokens"])):
        want = {p: float(sum(field(u) for u in us)) for p, us in client.usage.items()}
        got = prom.by("pool", f"ray_deltaserve_{metric}_total")
        assert {p: got.get(p, 0.0) for p in want} == want, metric
    assert prom.by("code", "ray_deltaserve_requests_total") == {str(c): float(n) for c, n in client.codes.items()}
    assert prom.by("limit", 'ray_deltaserve_rate_limited_total{tenant="bob"}') == {"requests": 1.0}
    slo = prom.by("pool", 'ray_deltaserve_slo_total{target="both"}')
    assert slo == {p: float(n) for p, n in served.items()}  # every served request is met or missed

    failovers = ingress_failovers(up)
    assert failovers >= 1, "killing a decode replica under 6 streams caused no failover"
    assert prom.total("ray_deltaserve_failovers_total") == failovers
    print(f"\n[test_metrics_platform] served per pool {served}, codes {dict(client.codes)}, failovers {failovers}")

    prices = {pool: pc.price for pool, pc in PlatformConfig().pools.items()}
    for pool, usages in client.usage.items():
        p = prices[pool]
        hand = sum(((u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]) * p.input
                    + u["prompt_tokens_details"]["cached_tokens"] * p.cached_input + u["completion_tokens"] * p.output) / 1e6
                   for u in usages)
        assert prom.by("pool", "ray_deltaserve_cost_usd_total")[pool] == pytest.approx(hand, rel=1e-9, abs=1e-12), pool
        assert sum(u["cost"] for u in usages) == pytest.approx(hand, rel=1e-9, abs=1e-12), pool

    # Serve's labels, and the per-replica metrics of every engine deployment
    for s in prom.series("ray_deltaserve_ttft_seconds_count"):
        assert s["application"] == "deltaserve" and s["deployment"] == "ingress" and s["replica"], s
    deployments = {s["deployment"] for s in prom.series("ray_deltaserve_slots_total")}
    assert {f"{k}-{p}" for k in ("prefill", "decode") for p in MODELS} <= deployments, deployments
    steps = prom.by("deployment", 'ray_deltaserve_step_seconds_count{step!="prefill"}')
    assert set(steps) >= {"decode-standard", "decode-highspeed"}, steps
