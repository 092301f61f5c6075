"""The autoscaler runs inside Serve: on `deltaserve up --autoscale --budget 0.7 --budget-unit cpus`, Serve calls
the application-level policy, applies its targets (seen as RUNNING replicas in serve.status), the policy
publishes its decision with the signal that set each target, and settings re-applied with the config
(a pin, a pause) are honoured. One platform for every check.

The budget counts Ray CPUs: a replica reserves 0.1, a decode-standard one 0.2 (replica_resources). standard's
batch cap is 4 here, so 12 open streams ask for 12 / 4 -> 3 decode replicas; once the other three
deployments hold their floor of 1 (0.3 CPU), the 0.4 CPU left gives decode-standard a ceiling of 2 (Serve's
max_replicas).
"""

from __future__ import annotations

import threading
import time

import openai
import pytest
import yaml

from deployments.autoscaling import live
from deployments.autoscaling.settings import OpsSettings
from tests.deployments.platform_fixture import MODELS, ray_driver, start_platform

BUDGET = 0.7  # CPUs
ENGINES = ("prefill-standard", "decode-standard", "prefill-highspeed", "decode-highspeed")
POOL = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "stream_interval_ms": 0}
# longer than any stream needs to last: the streams stop when the test has seen what it waits for (12 streams of
# 400 tokens were over within seconds on an idle machine, before a tick had published decode-standard's want of 3)
STREAM_TOKENS = 6000


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("autoscale")
    config = workdir / "platform.yaml"
    config.write_text(yaml.safe_dump({"pools": {"standard": POOL, "highspeed": POOL}, "autoscale": {"interval_s": 2,
        # the budget left after the wants stays unused: the targets below are the wants (the spare round: test_policy.py)
        "policy": {"premium_headroom": 0}}, "replica_resources": {"decode-standard": {"num_cpus": 0.2}}}))
    with start_platform(workdir, "--config", str(config), "--autoscale", "--budget", str(BUDGET),
                        "--budget-unit", "cpus") as p, ray_driver(p):
        yield p


def running(app: str = "deltaserve") -> dict[str, int]:
    states = live.replica_states(app)
    return {name: states.get(name, {}).get("RUNNING", 0) for name in ENGINES}


def wait_for(check, timeout_s: float, what: str):
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"{what}: not reached in {timeout_s:.0f} s; last {last!r}, status {live.read_status()}")


def status_where(predicate, timeout_s: float, what: str) -> dict:
    return wait_for(lambda: (s := live.read_status()) is not None and predicate(s) and s, timeout_s, what)


def targets(status: dict) -> dict[str, int]:
    return {n: d["target"] for n, d in status["deployments"].items()}


def streams(platform, n: int, errors: list, stop: threading.Event) -> list[threading.Thread]:
    """``n`` greedy streams that run until ``stop`` is set (then the client closes them, as a client that hangs
    up does): the load lasts as long as the test needs it, however fast this machine decodes."""
    client = openai.OpenAI(base_url=f"{platform.http_url}/v1", api_key=platform.key, timeout=300, max_retries=0)

    def one(i: int) -> None:
        try:
            out = client.completions.create(model=MODELS[0], prompt=f"stream {i}:", max_tokens=STREAM_TOKENS,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
            chunks = 0
            for _ in out:
                chunks += 1
                if stop.is_set():
                    break
            out.close()
            assert chunks > 0
        except Exception as e:  # noqa: BLE001 - every failure is reported by the test
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_serve_calls_the_policy_and_applies_its_targets(platform):
    idle = status_where(lambda s: set(s["deployments"]) == set(ENGINES), 60, "a first published decision")
    assert (idle["budget"], idle["unit"], idle["paused"]) == (BUDGET, "cpus", False)
    assert targets(idle) == dict.fromkeys(ENGINES, 1), idle
    assert all(d["reason"].startswith(f"{n}: 1 -> 1: ") for n, d in idle["deployments"].items()), idle

    errors: list[str] = []
    stop = threading.Event()
    threads = streams(platform, 12, errors, stop)
    try:
        # once the streams are all in, decode-standard wants 3 or more; its ceiling (the budget's 0.7 CPU less the
        # other three deployments' floors, over its 0.2 a replica) holds it at 2
        loaded = status_where(lambda s: s["deployments"]["decode-standard"]["wanted"] >= 3, 90,
                              "decode-standard wanting 3 or more under 12 streams")
        decode = loaded["deployments"]["decode-standard"]
        assert decode["target"] == 2 and decode["reason"].endswith("held at ceiling 2"), decode
        assert "waiting" in decode["reason"] and "batch cap 4" in decode["reason"], decode
        assert targets(loaded) == {"prefill-standard": 1, "decode-standard": 2, "prefill-highspeed": 1,
                                   "decode-highspeed": 1}, loaded
        assert loaded["spent"] == pytest.approx(BUDGET)  # 0.1 x 3 + 0.2 x 2 CPUs
        wait_for(lambda: running() == targets(loaded), 120, "Serve running the policy's targets")
    finally:
        stop.set()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors


def test_pins_and_pause_in_a_reapplied_config_are_honoured(platform):
    config = live.running_app_config()
    live.apply_app_config(live.with_settings(config, OpsSettings(pins={"decode-highspeed": 2})))
    pinned = status_where(lambda s: s["deployments"]["decode-highspeed"]["pinned"], 240, "the pin in the status")
    # the pin costs the budget: decode-standard gives its second replica back at once
    assert targets(pinned) == {"prefill-standard": 1, "decode-standard": 1, "prefill-highspeed": 1,
                               "decode-highspeed": 2}, pinned
    assert "pinned at 2" in pinned["deployments"]["decode-highspeed"]["reason"], pinned
    wait_for(lambda: running() == targets(pinned), 240, "Serve running the pinned targets")

    live.apply_app_config(live.with_settings(live.running_app_config(), OpsSettings(paused=True)))
    paused = status_where(lambda s: s["paused"], 240, "the pause in the status")
    assert targets(paused) == targets(pinned), paused  # the pin is released, but nothing moves while paused
    assert all("autoscaler paused" in d["reason"] and not d["pinned"] for d in paused["deployments"].values()), paused
    # new settings rebuild the application (they are part of its code version): Serve restarts every replica,
    # each deployment at its initial_replicas, and the paused policy restores the targets it had published
    wait_for(lambda: running() == targets(pinned), 240, "Serve running the held targets after the rebuild")
    time.sleep(6)  # three more ticks: nothing moves
    assert targets(live.read_status()) == targets(pinned) == running()
