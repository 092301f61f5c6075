"""The live autoscaler benchmark's per-replica CPU allowance (benchmarks/cpu_caps.py): a capped process gets its
quota of a core and no more, a replica process is found by the title Serve gives it, and the cgroups go away."""

import os
import subprocess
import sys
import time

import pytest

from benchmarks.cpu_caps import CpuCaps, available, cfs_period_quota_us, replica_processes

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no CPU caps here: {available()}")

BUSY = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 60: pass\n"


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_capped_replica_process_gets_its_quota_and_the_groups_are_removed():
    # a busy process titled as Serve titles an engine replica (argv[0] is the title Ray sets)
    proc = subprocess.Popen(["ray::ServeReplica:deltaserve:prefill-highspeed", "-c", BUSY], executable=sys.executable)
    other = subprocess.Popen(["ray::ServeReplica:deltaserve:ingress", "-c", BUSY], executable=sys.executable)
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in replica_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        found = replica_processes()
        assert found.get(proc.pid) == "prefill-highspeed" and other.pid not in found  # the ingress is not capped
        with CpuCaps(0.2, scan_s=0.05) as caps:
            deadline = time.monotonic() + 5
            while proc.pid not in caps.capped and time.monotonic() < deadline:
                time.sleep(0.02)
            assert caps.capped == {proc.pid: "prefill-highspeed"}
            c0, w0 = _cpu_s(proc.pid), time.monotonic()
            time.sleep(1.5)
            share = (_cpu_s(proc.pid) - c0) / (time.monotonic() - w0)
            base = caps.base
        assert share == pytest.approx(0.2, abs=0.06), share  # uncapped it would keep a core busy
        assert not base.exists()
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()


def test_bad_allowance_is_named_and_a_small_one_gets_a_longer_period():
    with pytest.raises(ValueError, match="cpus must be in"):
        CpuCaps(0.0)
    caps = CpuCaps(0.05)  # 0.5 ms of a 10 ms period is under the kernel's 1 ms least quota
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert cfs_period_quota_us(0.05) == (20_000, 1_000) and cfs_period_quota_us(0.25) == (10_000, 2_500)
        caps.cap(idle.pid, "idle")  # the kernel takes the quota and the process
        assert (caps.base / f"idle-{idle.pid}" / "cgroup.procs").read_text().split() == [str(idle.pid)]
        other = CpuCaps(0.25)  # another one, and the probe its construction runs, leave this one's groups alone
        other.close()
        assert (caps.base / f"idle-{idle.pid}" / "cgroup.procs").read_text().split() == [str(idle.pid)]
    finally:
        caps.close()
        idle.kill()
        idle.wait()
    assert not caps.base.exists() and not other.base.exists()
