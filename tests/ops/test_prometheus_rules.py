"""ops/prometheus/ with Prometheus's own checker: the config and rules are valid (`promtool check`), the
rule unit tests pass (`promtool test rules`: recorded values by hand, every alert firing and silent), and
every metric the rules read is one deltaserve or Ray Serve exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deployments.observability.metrics import CATALOG
from deployments.observability.prometheus import CONFIG_FILE, RULES_DIR

OPS = CONFIG_FILE.parent
TESTS_DIR = OPS / "tests"
RULE_FILES = sorted(RULES_DIR.glob("*.yml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install "
                                    "prometheus; `make serve` does as root)")


def _promtool(*args: str, cwd: Path = OPS) -> str:
    done = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _rules() -> list[dict]:
    return [rule for f in RULE_FILES for group in yaml.safe_load(f.read_text())["groups"] for rule in group["rules"]]


@needs_promtool
def test_promtool_check_rules():
    out = _promtool("check", "rules", *map(str, RULE_FILES))
    for f in RULE_FILES:  # each file: checked, with as many rules as it holds
        n = sum(len(g["rules"]) for g in yaml.safe_load(f.read_text())["groups"])
        assert f"Checking {f}\n  SUCCESS: {n} rules found" in out, out


@needs_promtool
def test_promtool_check_config_loads_every_rule_file():
    out = _promtool("check", "config", str(CONFIG_FILE))
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in out, out
    assert f"SUCCESS: {CONFIG_FILE} is valid prometheus config file syntax" in out, out


@needs_promtool
def test_promtool_test_rules():
    files = sorted(TESTS_DIR.glob("*.yml"))
    assert [f.name for f in files] == ["alerts_test.yml", "recording_test.yml"]
    out = _promtool("test", "rules", *(f.name for f in files), cwd=TESTS_DIR)
    assert out.count("SUCCESS") == len(files), out


def test_every_alert_has_a_firing_and_a_silent_case_and_says_what_to_do():
    alerts = {r["alert"]: r for r in _rules() if "alert" in r}
    cases: dict[str, list[list]] = {}
    for test in yaml.safe_load((TESTS_DIR / "alerts_test.yml").read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(case.get("exp_alerts") or [])
    assert sorted(cases) == sorted(alerts), "alerts without unit tests, or tests of no alert"
    for name, expected in cases.items():
        assert any(expected) and not all(expected), f"{name}: needs a case where it fires and one where it does not"
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert {"summary", "description", "action"} <= set(rule["annotations"]), name


def test_rules_read_only_metrics_that_exist():
    """Every ``ray_*`` series a rule reads is a catalog metric as Ray exports it (``ray_`` + name; histograms
    as ``_bucket``) or one of Ray Serve's own (its name in Ray's Serve sources), and every recorded series a
    rule reads is recorded by another rule."""
    import ray.serve

    exported = {f"ray_{s.name}" + ("_bucket" if s.kind == "histogram" else "") for s in CATALOG.values()}
    serve_sources = "".join(p.read_text() for p in Path(ray.serve.__file__).parent.joinpath("_private").glob("*.py"))
    rules = _rules()
    recorded = {r["record"] for r in rules if "record" in r}
    read = {m for r in rules for m in re.findall(r"\b(ray_[a-z0-9_]+)", r["expr"])}
    unknown = sorted(m for m in read if m not in exported
                     and not (m.startswith("ray_serve_") and f'"{m.removeprefix("ray_")}"' in serve_sources))
    assert unknown == []
    reads_recorded = {m for r in rules for m in re.findall(r"\b([a-z_]+:[a-z0-9_]+:[a-z0-9_]+)", r["expr"])}
    assert sorted(reads_recorded - recorded) == []
