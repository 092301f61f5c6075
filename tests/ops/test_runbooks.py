"""Every command of every runbook in ops/runbooks/, in order, against ONE live
`deltaserve up --autoscale --budget 6` (with its embedded Prometheus and local redis-server): each
must exit 0 and print what its `# expect:` lines say (ops/runbooks/README.md, "Format")."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deployments.platform_fixture import Platform
from tests.deployments.up_process import deltaserve_up

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "ops" / "runbooks"
# one platform for all, in this order: each runbook gives back what it changes (a pin is released, the budget
# returned, a pause resumed; a drained replica is replaced), so the next one starts from the same platform
ORDER = ["drain-replica.md", "burst-standard.md", "launch-highspeed.md", "redis-down.md", "crash-loop.md",
         "slo-burn-rate.md"]
FENCE = re.compile(r"^```console\n(.*?)^```", re.M | re.S)


@dataclass
class Step:
    runbook: str
    command: str
    expect: list[str] = field(default_factory=list)


def steps(path: Path) -> list[Step]:
    """The runbook's commands with their expectations, in order."""
    out: list[Step] = []
    for block in FENCE.findall(path.read_text()):
        for line in block.splitlines():
            if line.startswith("$ "):
                out.append(Step(path.name, line[2:]))
            elif line.startswith("# expect: "):
                assert out, f"{path.name}: an expect line before any command"
                out[-1].expect.append(line[len("# expect: "):])
            elif line.strip():
                raise AssertionError(f"{path.name}: a console line that is neither `$ ` nor `# expect: `: {line!r}")
    return out


def test_every_runbook_is_in_the_order_and_has_commands():
    assert sorted(p.name for p in RUNBOOKS.glob("*.md") if p.name != "README.md") == sorted(ORDER)
    for name in ORDER:
        found = steps(RUNBOOKS / name)
        assert found and all(s.expect for s in found), name
        for s in found:
            for regex in s.expect:
                re.compile(regex, re.M)


def test_every_runbook_command_against_a_live_platform(tmp_path):
    key, token = f"ds-{secrets.token_urlsafe(32)}", secrets.token_hex(16)
    ray_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    with deltaserve_up(["--autoscale", "--budget", "6", "--tenants", str(tmp_path / "tenants.yaml")],
                       env={"DELTASERVE_API_KEY": key, **ray_env}, prometheus=True) as up:
        redis = next(re.search(r"redis://\S+", ln).group(0) for ln in up.output if "started a local redis-server" in ln)
        platform = Platform(f"http://127.0.0.1:{up.http_port}", "", key, "", up.proc, ray_env)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}, **ray_env,
               "RAY_ADDRESS": platform.gcs_address(), "DELTASERVE_URL": platform.http_url, "DELTASERVE_API_KEY": key,
               "PROMETHEUS_URL": up.prometheus_url, "DELTASERVE_REDIS_URL": redis,
               "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        for name in ORDER:
            for step in steps(RUNBOOKS / name):
                r = subprocess.run(["bash", "-o", "pipefail", "-c", step.command], cwd=ROOT, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=420)
                assert r.returncode == 0, f"{name}: `{step.command}` exited {r.returncode}:\n{r.stdout}"
                for regex in step.expect:
                    assert re.search(regex, r.stdout, re.M), f"{name}: `{step.command}` printed no /{regex}/:\n{r.stdout}"
