"""Cost per successful task through `deltaserve up`: a scripted day of tasks over HTTP and gRPC, then
`deltaserve usage` (JSON and the table, from Redis and through the running platform) shows exactly the
figures this test computes by hand from the price table in the platform config and the responses' usage.

The day: tenant alice runs a task that succeeds on standard (two HTTP requests and one over gRPC), a task
on both pools that succeeds with a conversation resumed from the cache (so cached prompt tokens are charged
at the cached price), a task that fails, a task left open on highspeed, and one request outside any task;
tenant bob runs one task that succeeds (reported over gRPC) and cannot report alice's task (404). Every
response's ``usage.cost`` equals the hand computation too, and Ray's metrics export port shows the same
figures as the ``deltaserve_tenant_*`` gauges (cache-admin exports them every second here) and the
``deltaserve_cost_usd_total`` counter.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction

import grpc
import httpx
import pytest
import yaml

from cache_service import LocalRedisServer
from deployments.proto.deltaserve.v1 import inference_pb2 as pb
from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pbg
from deployments.tenancy import TenantRegistry
from tests.deployments.up_process import ROOT, deltaserve_up

# USD per million tokens, and the same as pico-USD per token (x 1e6): the hand computation's table
PRICES = {"standard": {"input": 0.37, "cached_input": 0.091, "output": 1.234567},
          "highspeed": {"input": 2.2, "cached_input": 0.55, "output": 9.75}}
PICO = {pool: {k: round(v * 10**6) for k, v in p.items()} for pool, p in PRICES.items()}
MODELS = {"standard": "k3-tiny", "highspeed": "k3-tiny-highspeed"}


def cost_pico(pool: str, prompt: int, cached: int, output: int) -> int:
    p = PICO[pool]
    return (prompt - cached) * p["input"] + cached * p["cached_input"] + output * p["output"]


def usd(pico: int) -> float:
    return float(Fraction(pico, 10**12))


def table_usd(pico: int, tasks: int = 1) -> str:
    """The table's form: USD to the pico-USD, half even."""
    return str((Decimal(pico) / tasks / 10**12).quantize(Decimal("0.000000000001"), rounding=ROUND_HALF_EVEN))


class Day:
    """Sends the day's requests and keeps, per tenant and pool, what a hand computation needs."""

    def __init__(self, up, keys: dict[str, str]) -> None:
        self.http = f"http://127.0.0.1:{up.http_port}"
        self.grpc = pbg.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{up.grpc_port}"))
        self.keys = keys
        self.spent: dict[tuple[str, str], dict[str, int]] = {}  # (tenant, pool) → requests, tokens, cost, task_cost
        self.cached_seen = 0

    def _count(self, tenant: str, pool: str, task: str | None, prompt: int, cached: int, output: int,
               cost_usd: float) -> None:
        pico = cost_pico(pool, prompt, cached, output)
        assert cost_usd == usd(pico), (tenant, pool, prompt, cached, output, cost_usd)
        row = self.spent.setdefault((tenant, pool), dict.fromkeys(("requests", "input", "cached", "output", "cost",
                                                                   "task_cost"), 0))
        for k, v in (("requests", 1), ("input", prompt - cached), ("cached", cached), ("output", output),
                     ("cost", pico), ("task_cost", pico if task else 0)):
            row[k] += v
        self.cached_seen += cached

    def chat(self, tenant: str, pool: str, task: str | None, content: str, session: str | None = None) -> dict:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        headers.update({"x-task-id": task} if task else {})
        headers.update({"x-session-id": session} if session else {})
        body = {"model": MODELS[pool], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "system", "content": "You are a careful assistant. " * 12},
                             {"role": "user", "content": content}]}
        r = httpx.post(f"{self.http}/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        cached = u["prompt_tokens_details"]["cached_tokens"]
        assert u["cost_details"] == {"input": usd((u["prompt_tokens"] - cached) * PICO[pool]["input"]),
                                     "cached_input": usd(cached * PICO[pool]["cached_input"]),
                                     "output": usd(u["completion_tokens"] * PICO[pool]["output"])}
        self._count(tenant, pool, task, u["prompt_tokens"], cached, u["completion_tokens"], u["cost"])
        return u

    def stream(self, tenant: str, pool: str, task: str | None, prompt: str) -> None:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}", **({"x-task-id": task} if task else {})}
        body = {"model": MODELS[pool], "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.http}/v1/completions", json=body, headers=headers, timeout=120) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        u = events[-1]["usage"]
        self._count(tenant, pool, task, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                    u["completion_tokens"], u["cost"])

    def generate(self, tenant: str, pool: str, task: str, prompt: str) -> None:
        resp = self.grpc.Generate(pb.GenerateRequest(model=MODELS[pool], prompt=prompt, max_tokens=4, temperature=0,
                                                     ignore_eos=True, task_id=task),
                                  metadata=(("authorization", f"Bearer {self.keys[tenant]}"),), timeout=120)
        u = resp.usage
        self._count(tenant, pool, task, u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.cost)

    def report(self, tenant: str, task: str, outcome: str) -> httpx.Response:
        return httpx.post(f"{self.http}/v1/tasks/{task}", json={"outcome": outcome},
                          headers={"Authorization": f"Bearer {self.keys[tenant]}"}, timeout=30)


def gcs_address(up) -> str:
    """The GCS address of the Ray cluster `deltaserve up` started (from the ``--gcs-address`` of a process under it)."""
    for pid in up.descendants():
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for a in args:
            if a.startswith("--gcs-address="):
                return a.split("=", 1)[1]
    raise AssertionError("no process with --gcs-address under deltaserve up")


def scrape(up, name: str) -> dict[str, float]:
    """``ray_<name>`` samples on Ray's metrics export port, by tenant (summed over the other labels)."""
    text = httpx.get(f"http://127.0.0.1:{up.metrics_export_port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(f"ray_{name}{{"):
            labels, value = line[len(name) + 5:].rsplit("} ", 1)
            tenant = next(p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith("tenant="))
            out[tenant] = out.get(tenant, 0.0) + float(value)
    return out


def wait_scraped(up, name: str, want: dict[str, float], timeout_s: float = 90) -> dict[str, float]:
    deadline, got = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        got = scrape(up, name)
        if got.keys() == want.keys() and all(got[t] == pytest.approx(v, rel=1e-9, abs=0) for t, v in want.items()):
            return got
        time.sleep(1)
    raise AssertionError(f"ray_{name} is {got}, want {want}")


def usage_cli(*args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", "deployments.cli.main", "usage", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("usage-platform")
    reg = TenantRegistry()
    _, alice = reg.add("alice", pools=["standard", "highspeed"], rpm=100_000, tpm=100_000_000, max_context=4096)
    _, bob = reg.add("bob", pools=["standard"], rpm=100_000, tpm=100_000_000, max_context=4096)
    reg.save(tmp / "tenants.yaml")
    (tmp / "config.yaml").write_text(yaml.safe_dump({"pools": {p: {"price": PRICES[p]} for p in PRICES},
                                                     "metrics": {"usage_export_s": 1.0}}))
    redis_server = LocalRedisServer().start()
    token = secrets.token_hex(16)
    try:
        with deltaserve_up(["--config", str(tmp / "config.yaml"), "--tenants", str(tmp / "tenants.yaml"),
                            "--redis-url", redis_server.url], env={"RAY_AUTH_TOKEN": token}) as up:
            yield up, {"alice": alice, "bob": bob}, redis_server.url, token
    finally:
        redis_server.stop()


def scripted_day(day: Day) -> dict[str, dict[str, int]]:
    """The day's tasks; returns each tenant's tasks by outcome."""
    day.chat("alice", "standard", "ok-1", "Write a haiku about queues.")
    day.stream("alice", "standard", "ok-1", "def fib(n):")
    day.generate("alice", "standard", "ok-1", "SELECT * FROM")
    assert day.report("alice", "ok-1", "success").status_code == 200
    # a conversation resumed from the cache: the same session, the same first turn, until a turn is served cached
    first = day.chat("alice", "highspeed", "ok-2", "Summarise the plan.", session="s-ok-2")
    for _ in range(20):
        if day.chat("alice", "highspeed", "ok-2", "Summarise the plan.", session="s-ok-2")["prompt_tokens_details"][
                "cached_tokens"]:
            break
        time.sleep(0.5)
    assert day.cached_seen > 0, f"no turn was served from the cache (first turn: {first})"
    day.chat("alice", "standard", "ok-2", "And the risks?")
    assert day.report("alice", "ok-2", "success").json()["requests"] >= 3
    day.chat("alice", "standard", "bad-1", "Prove P = NP.")
    assert day.report("alice", "bad-1", "failure").status_code == 200
    day.chat("alice", "highspeed", "open-1", "Left open.")
    day.chat("alice", "standard", None, "No task at all.")
    day.chat("bob", "standard", "b-1", "Hello from bob.")
    r = day.report("bob", "ok-1", "success")  # alice's task id
    assert r.status_code == 404 and r.json()["error"]["code"] == "task_not_found"
    out = day.grpc.ReportTaskOutcome(pb.ReportTaskOutcomeRequest(task_id="b-1", outcome="success"),
                                     metadata=(("authorization", f"Bearer {day.keys['bob']}"),), timeout=30)
    assert (out.outcome, out.requests) == ("success", 1)
    assert day.report("alice", "ok-1", "failure").status_code == 409
    return {"alice": {"succeeded": 2, "failed": 1, "open": 1}, "bob": {"succeeded": 1, "failed": 0, "open": 0}}


def test_usage_shows_the_hand_computed_cost_per_successful_task(platform):
    up, keys, redis_url, token = platform
    day = Day(up, keys)
    tasks = scripted_day(day)
    report = json.loads(usage_cli("--redis-url", redis_url, "--json"))
    via_platform = json.loads(usage_cli("--json", env={"RAY_ADDRESS": gcs_address(up), "RAY_AUTH_MODE": "token",
                                                       "RAY_AUTH_TOKEN": token}))
    assert report["source"] == via_platform["source"] == "redis"
    assert via_platform["tenants"] == report["tenants"]
    table = usage_cli("--redis-url", redis_url, "--since", "24h")
    print(table)
    for tenant, outcomes in tasks.items():
        got = report["tenants"][tenant]
        pools = {pool: row for (t, pool), row in day.spent.items() if t == tenant}
        assert got["pools"].keys() == pools.keys()
        for pool, row in pools.items():
            g = got["pools"][pool]
            assert (g["requests"], g["tokens"], g["cost_pico_usd"], g["task_cost_pico_usd"]) == (
                row["requests"], {"input": row["input"], "cached": row["cached"], "output": row["output"]},
                row["cost"], row["task_cost"]), (tenant, pool)
            assert g["cost_usd"] == usd(row["cost"])
        task_spend = sum(r["task_cost"] for r in pools.values())
        total = got["total"]
        assert total["tasks"] == outcomes and total["task_cost_pico_usd"] == task_spend
        per_task = float(Fraction(task_spend, outcomes["succeeded"] * 10**12))
        assert total["cost_per_successful_task_usd"] == per_task
        line = next(ln.split() for ln in table.splitlines() if ln.split()[:2] == [tenant, "all"])
        assert line[2:] == [str(sum(r["requests"] for r in pools.values())), "0",
                            str(sum(r["input"] for r in pools.values())), str(sum(r["cached"] for r in pools.values())),
                            str(sum(r["output"] for r in pools.values())),
                            table_usd(sum(r["cost"] for r in pools.values())), str(outcomes["succeeded"]),
                            str(outcomes["failed"]), str(outcomes["open"]), table_usd(task_spend, outcomes["succeeded"])]
        print(f"{tenant}: cost per successful task {table_usd(task_spend, outcomes['succeeded'])} USD "
              f"(hand: {task_spend} pico-USD / {outcomes['succeeded']} tasks)")
    assert report["tenants"]["alice"]["pools"]["highspeed"]["tokens"]["cached"] > 0  # charged at the cached price
    # exported as metrics: cache-admin's gauges (every usage_export_s) and the ingress's cost counter (USD floats,
    # so equal to the pico-USD figures within float rounding)
    per_task = {t: report["tenants"][t]["total"]["cost_per_successful_task_usd"] for t in tasks}
    spend = {t: usd(report["tenants"][t]["total"]["cost_pico_usd"]) for t in tasks}
    print("scraped", wait_scraped(up, "deltaserve_tenant_cost_per_successful_task_usd", per_task),
          wait_scraped(up, "deltaserve_tenant_cost_usd", spend), wait_scraped(up, "deltaserve_cost_usd_total", spend))
    assert wait_scraped(up, "deltaserve_tenant_tasks", {t: float(sum(o.values())) for t, o in tasks.items()})
