"""A CPU allowance per engine replica on one machine, as a Kubernetes CPU limit gives each pod (CFS quota).

On a shared machine every Serve replica competes for the same cores, so a replica added to a deployment adds
no capacity: it takes CPU from the others. In a cluster (the KubeRay manifests give every worker pod a CPU
limit) a replica brings its own. :class:`CpuCaps` puts every engine replica process of a running
`deltaserve up` (prefill, decode and expert-pool deployments; not the ingress, HAProxy or Ray's own
processes) into a cgroup of its own whose CFS quota is ``cpus`` cores, so that on one machine a replica is a
fixed slice of CPU that the autoscaler can move between deployments, as it moves pods in a cluster.

A thread scans the processes every ``scan_s`` and caps every new replica process as it appears (a replica the
autoscaler starts runs its first fraction of a second uncapped). The quota period is short (10 ms) so a
capped step is slowed evenly rather than run at full speed and then stopped for most of a 100 ms period
(longer for allowances under 0.1 core: the kernel takes no quota under 1 ms).

Needs root and the cgroup v1 ``cpu`` controller at ``/sys/fs/cgroup/cpu`` or cgroup v2 with the ``cpu``
controller at ``/sys/fs/cgroup``; :func:`available` says whether this machine has either. The cgroups are
removed (their processes moved back to the root group) when the context exits.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from pathlib import Path

ENGINE_PREFIXES = ("prefill-", "decode-", "expert-pool-")  # engine deployments' names (deployments/app.py)
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel refuses a CFS quota under 1 ms
_SEQ = itertools.count()
TITLE = "ray::ServeReplica:"  # + "<app>:<deployment>", the process title Serve gives a replica's worker


def _v1_root() -> Path | None:
    root = Path("/sys/fs/cgroup/cpu")
    return root if (root / "cpu.cfs_quota_us").exists() else None


def _v2_root() -> Path | None:
    root = Path("/sys/fs/cgroup")
    try:
        return root if "cpu" in (root / "cgroup.controllers").read_text().split() else None
    except OSError:
        return None


def available() -> str | None:
    """None when this process can make CPU-capped cgroups here (tried: a group made, given a quota, removed),
    else why not."""
    if os.geteuid() != 0:
        return "needs root (cgroups)"
    if _v1_root() is None and _v2_root() is None:
        return "no cgroup cpu controller at /sys/fs/cgroup/cpu (v1) or /sys/fs/cgroup (v2)"
    try:
        probe = CpuCaps(0.5, _checked=True)
        try:
            probe._group("probe")
        finally:
            probe.close()
    except OSError as e:
        return f"cannot make a CPU-capped cgroup here ({e.strerror}: {e.filename})"
    return None


def cfs_period_quota_us(cpus: float) -> tuple[int, int]:
    """The CFS period and quota for ``cpus`` cores: a 10 ms period, longer where the quota would fall under the
    kernel's least (1 ms)."""
    period = max(PERIOD_US, math.ceil(MIN_QUOTA_US / cpus))
    return period, max(MIN_QUOTA_US, round(cpus * period))


def _new_base() -> Path:
    """A parent group of its own for each :class:`CpuCaps` (closing one never touches another's groups)."""
    root = _v1_root() or _v2_root()
    assert root is not None
    return root / f"deltaserve-caps-{os.getpid()}-{next(_SEQ)}"


def _remove(base: Path) -> None:
    """``base``'s groups' processes back to the root group, the groups removed."""
    root = _v1_root() or _v2_root()
    for g in sorted(base.glob("*/"), reverse=True):
        try:
            for pid in (g / "cgroup.procs").read_text().split():
                try:
                    (root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            g.rmdir()
        except OSError:
            pass
    try:
        base.rmdir()
    except OSError:
        pass


def replica_processes() -> dict[int, str]:
    """pid -> deployment of every engine replica process running now (Serve sets the process title to
    ``ray::ServeReplica:<app>:<deployment>`` and appends the method it is in)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            title = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        if not title.startswith(TITLE):
            continue
        _app, _, rest = title[len(TITLE):].partition(":")  # "<deployment>[.<method>]", space-padded
        deployment = rest.split(".", 1)[0].strip()
        if deployment.startswith(ENGINE_PREFIXES):
            out[int(d)] = deployment
    return out


class CpuCaps:
    """``cpus`` cores for each engine replica process (and for any process :meth:`cap` is given)."""

    def __init__(self, cpus: float, scan_s: float = 0.2, *, _checked: bool = False) -> None:
        if not 0.01 <= cpus <= (os.cpu_count() or 1):
            raise ValueError(f"CPU caps per replica: cpus must be in [0.01, {os.cpu_count()}], got {cpus!r}")
        why = None if _checked else available()
        if why:
            raise RuntimeError(f"CPU caps per replica: {why}")
        self.cpus, self.scan_s = cpus, scan_s
        self.v1 = _v1_root()
        self.base = _new_base()
        self.base.mkdir()
        if not self.v1:  # v2: the parent must hand the cpu controller down to its children
            try:
                (self.base / "cgroup.subtree_control").write_text("+cpu")
            except OSError:
                _remove(self.base)
                raise
        self.capped: dict[int, str] = {}  # pid -> deployment
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-caps")

    def _group(self, name: str) -> Path:
        g = self.base / name
        if not g.exists():
            g.mkdir()
            period, quota = cfs_period_quota_us(self.cpus)
            if self.v1:
                (g / "cpu.cfs_period_us").write_text(str(period))
                (g / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (g / "cpu.max").write_text(f"{quota} {period}")
        return g

    def cap(self, pid: int, label: str) -> None:
        """Move ``pid`` (every thread of it) into a cgroup of its own with the quota."""
        (self._group(f"{label}-{pid}") / "cgroup.procs").write_text(str(pid))
        self.capped[pid] = label

    def scan(self) -> None:
        for pid, deployment in replica_processes().items():
            if pid not in self.capped:
                try:
                    self.cap(pid, deployment)
                except OSError:  # it exited meanwhile
                    pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self.scan()
            self._stop.wait(self.scan_s)

    def __enter__(self) -> CpuCaps:  # noqa: PYI034
        self.scan()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.close()

    def close(self) -> None:
        """Processes back to the root group, the cgroups removed."""
        _remove(self.base)


def capped_preexec(cpus: float, label: str):
    """A ``subprocess`` ``preexec_fn`` that puts the child into a fresh cgroup with the quota (the profile
    measured at a replica's allowance)."""
    caps = CpuCaps(cpus)

    def enter() -> None:
        caps.cap(os.getpid(), label)

    return caps, enter


if __name__ == "__main__":  # a self-check: one busy process at 0.25 and at the full core
    import subprocess
    import sys

    def burn(preexec_fn=None) -> float:
        code = "import time\nt=time.perf_counter();n=0\nwhile time.perf_counter()-t<1.0: n+=1\nprint(n)"
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    preexec_fn=preexec_fn).stdout)

    full = burn()
    caps, enter = capped_preexec(0.25, "selfcheck")
    try:
        capped = burn(enter)
    finally:
        caps.close()
    print(f"loop iterations in 1 s: full {full:.0f}, capped at 0.25 core {capped:.0f} ({capped / full:.2f}x)")
