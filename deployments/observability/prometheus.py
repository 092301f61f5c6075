"""The local Prometheus `deltaserve up` starts: Debian's `prometheus`, on 127.0.0.1, scraping Ray.

Ray's metrics agent on every node exports Ray's, Serve's and the ``deltaserve_*`` metrics on the
node's metrics export port; Ray lists those addresses (and those of its dashboard and autoscaler)
in its Prometheus service-discovery file, ``<session dir>/prom_metrics_service_discovery.json``
(linked at ``<temp dir>/prom_metrics_service_discovery.json``, ``/tmp/ray/...`` by default).
Ray's dashboard head writes that file, and `deltaserve up` starts Ray without it
(``include_dashboard=False``), so :class:`DiscoveryFile` runs Ray's own writer
(``ray._private.metrics_agent.PrometheusServiceDiscoveryWriter``) in the `deltaserve up` process.

The Prometheus configuration is ``ops/prometheus/prometheus.yml``, the file a Prometheus the user
runs can take as is, rendered (:func:`render_config`) with this session's discovery file, the
rules directory as an absolute path and the platform's scrape interval. Data lives in the Ray
session directory (``<session>/prometheus/``), with Ray's logs of the same run.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from cache_service.redis_server import die_with_parent
from deployments.config import MetricsConfig

OPS_DIR = Path(__file__).resolve().parents[2] / "ops" / "prometheus"
CONFIG_FILE = OPS_DIR / "prometheus.yml"  # the config a user's own Prometheus uses
RULES_DIR = OPS_DIR / "rules"
SCRAPE_JOB = "ray"  # the scrape job reading Ray's discovery file (Ray's own configs name it so too)
DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # ray._private.ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE
INSTALL_HINT = "install it with `apt-get install -y prometheus` (`make serve` does as root)"


class PrometheusUnavailable(RuntimeError):
    """The local Prometheus could not be started (no binary, a bad config, no readiness): the
    platform runs without it."""


def port_is_free(port: int) -> bool:
    """Whether ``port`` on 127.0.0.1 can be bound right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _duration(seconds: float) -> str:
    """A Prometheus duration: whole milliseconds (Prometheus takes no fractional seconds)."""
    ms = round(seconds * 1000)
    if ms < 1:
        raise ValueError(f"a Prometheus duration must be at least 1 ms, got {seconds!r} s")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def render_config(discovery_file: Path, *, scrape_interval_s: float, rules_dir: Path = RULES_DIR,
                  template: Path = CONFIG_FILE) -> dict:
    """``template`` (ops/prometheus/prometheus.yml) for one Ray session: the ``ray`` job reads
    ``discovery_file``, rules load from ``rules_dir`` (absolute: the rendered file lives elsewhere),
    and Ray is scraped every ``scrape_interval_s``. Everything else is the template's."""
    config = yaml.safe_load(template.read_text())
    jobs = [job for job in config.get("scrape_configs", []) if job.get("job_name") == SCRAPE_JOB]
    if len(jobs) != 1:
        raise ValueError(f"{template} must have exactly one scrape job named {SCRAPE_JOB!r}, found {len(jobs)}")
    jobs[0]["file_sd_configs"] = [{"files": [str(discovery_file)]}]
    config.setdefault("global", {})["scrape_interval"] = _duration(scrape_interval_s)
    config["rule_files"] = [str(rules_dir.resolve() / "*.yml")]
    return config


class DiscoveryFile:
    """Ray's service-discovery file for this session, rewritten every ``period_s`` by Ray's own
    writer (what Ray's dashboard head would run) until :meth:`stop`. Needs ``ray.init`` done in
    this process."""

    def __init__(self, period_s: float = 5.0) -> None:
        import ray
        from ray._private.metrics_agent import PrometheusServiceDiscoveryWriter

        node = ray._private.worker._global_node  # this driver's node: its session and temp dirs
        self._writer = PrometheusServiceDiscoveryWriter(
            ray.get_runtime_context().gcs_address, node.get_temp_dir_path(), node.get_session_dir_path())
        self.path = Path(self._writer.get_target_file_name())
        self.session_dir = Path(node.get_session_dir_path())
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-prometheus-discovery", daemon=True)

    def start(self) -> "DiscoveryFile":
        self._writer.write()  # the first version before Prometheus reads it
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            with contextlib.suppress(Exception):  # a node list Ray cannot give now: the last file stays
                self._writer.write()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._period_s + 5)


@dataclass
class LocalPrometheus:
    """A running ``prometheus`` child process on 127.0.0.1:``port``, its files in ``workdir``."""

    proc: subprocess.Popen
    port: int
    workdir: Path  # prometheus.yml (rendered), data/ (the TSDB), prometheus.log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 30) -> None:
        """Block until ``/-/ready`` answers 200 (config and rules loaded, TSDB open); else stop it
        and raise :class:`PrometheusUnavailable` with its log's tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusUnavailable(f"prometheus exited with status {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise PrometheusUnavailable(f"prometheus on {self.url} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 10) -> None:
        """SIGTERM (Prometheus flushes its head block), SIGKILL after ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_prometheus(config: dict, *, port: int, workdir: Path, binary: str = "prometheus",
                     ready_timeout_s: float = 30) -> LocalPrometheus:
    """Write ``config`` to ``workdir/prometheus.yml`` and run ``binary`` on 127.0.0.1:``port`` with
    its TSDB in ``workdir/data``; return once it is ready. :class:`PrometheusUnavailable` when the
    binary is missing, the port is taken, or it does not become ready."""
    exe = shutil.which(binary)
    if exe is None:
        raise PrometheusUnavailable(f"{binary!r} not found on PATH; {INSTALL_HINT}")
    if not port_is_free(port):
        raise PrometheusUnavailable(f"port {port} on 127.0.0.1 is in use (choose another with --prometheus-port)")
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [exe, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}"]
    with open(workdir / "prometheus.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)
    prometheus = LocalPrometheus(proc, port, workdir)
    prometheus.wait_ready(ready_timeout_s)
    return prometheus


class EmbeddedPrometheus:
    """What `deltaserve up` runs beside Ray: Ray's discovery file and a Prometheus reading it.
    Start it after ``ray.init`` in this process; :meth:`stop` ends both."""

    def __init__(self, metrics: MetricsConfig, *, binary: str = "prometheus") -> None:
        self.metrics = metrics
        self.binary = binary
        self.discovery: DiscoveryFile | None = None
        self.prometheus: LocalPrometheus | None = None

    @property
    def url(self) -> str | None:
        return self.prometheus.url if self.prometheus is not None else None

    def start(self) -> "EmbeddedPrometheus":
        """Raise :class:`PrometheusUnavailable` (nothing left running) if Prometheus cannot start."""
        if shutil.which(self.binary) is None:
            raise PrometheusUnavailable(f"{self.binary!r} not found on PATH; {INSTALL_HINT}")
        self.discovery = DiscoveryFile(period_s=min(5.0, self.metrics.scrape_interval_s)).start()
        config = render_config(self.discovery.path, scrape_interval_s=self.metrics.scrape_interval_s)
        try:
            self.prometheus = start_prometheus(config, port=self.metrics.prometheus_port, binary=self.binary,
                                               workdir=self.discovery.session_dir / "prometheus")
        except BaseException:
            self.discovery.stop()
            raise
        return self

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.discovery is not None:
            self.discovery.stop()
