"""What runs beside the Ray cluster: Redis (the cache's second tier), the OTel Collector, Tempo and
Grafana. Each is a ServiceAccount, a Deployment and a Service; their configuration files travel as
ConfigMaps that kustomize generates (``render.py``): a changed file gets a new ConfigMap name, so the
Deployment rolls.

Every pod runs as a fixed non-root user with a read-only root filesystem; what a process writes goes
to an ``emptyDir``. Redis keeps nothing on disk (the cache is soft state: a lost entry is recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from deployments.config import PlatformConfig
from deployments.kube import names as n

REDIS_IMAGE = "redis:7.2.5-alpine"
COLLECTOR_IMAGE = "otel/opentelemetry-collector-contrib:0.111.0"
TEMPO_IMAGE = "grafana/tempo:2.6.1"
GRAFANA_IMAGE = "grafana/grafana:11.6.0"  # the release grafana-foundation-sdk's 11.6 build targets
IMAGES = (REDIS_IMAGE, COLLECTOR_IMAGE, TEMPO_IMAGE, GRAFANA_IMAGE)

COLLECTOR_CONFIG = f"{n.COLLECTOR}-config"  # ConfigMap names before kustomize's hash suffix
TEMPO_CONFIG = f"{n.TEMPO}-config"
GRAFANA_DATASOURCES = f"{n.GRAFANA}-datasources"
GRAFANA_PROVIDERS = f"{n.GRAFANA}-dashboard-providers"


@dataclass(frozen=True)
class Addons:
    """The choices addons depend on beyond the platform config."""

    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"  # the Prometheus operator's governing Service
    collector_replicas: int = 2
    tempo_retention: str = "24h"


def deployment(name: str, component: str, spec: dict, *, replicas: int = 1, recreate: bool = False) -> dict:
    """A Deployment of ``component`` whose pod spec is ``spec`` (its own ServiceAccount, no API token)."""
    pod = {"serviceAccountName": component, "automountServiceAccountToken": False, **spec}
    out = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": n.meta(name, component),
           "spec": {"replicas": replicas, "selector": {"matchLabels": n.selector(component)},
                    "template": {"metadata": {"labels": n.labels(component)}, "spec": pod}}}
    if recreate:
        out["spec"]["strategy"] = {"type": "Recreate"}
    return out


def _resources(cpu: str, memory: str, cpu_limit: str | None = None) -> dict:
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": {"cpu": cpu_limit or cpu, "memory": memory}}


def redis_script(maxmemory_mib: int, *, port: int = n.REDIS_PORT, data_dir: str = "/data",
                 bind: str = "0.0.0.0") -> str:
    """The Redis container's command (``sh -c``): ``$REDIS_PASSWORD`` goes into a config file only its
    owner reads (not into argv, where ``ps`` shows it), then redis-server replaces the shell."""
    return (f"umask 077 && printf 'requirepass %s\\n' \"$REDIS_PASSWORD\" > {data_dir}/redis.conf && "
            f"exec redis-server {data_dir}/redis.conf --bind {bind} --port {port} --maxmemory {maxmemory_mib}mb "
            "--maxmemory-policy allkeys-lru --save '' --appendonly no")


def redis_probe(port: int = n.REDIS_PORT) -> str:
    """The readiness check: an authenticated PING (the password from the environment, not argv)."""
    return f'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli -p {port} ping | grep -q PONG'


def redis(config: PlatformConfig) -> list[dict]:
    """Redis with its password from a Secret (:func:`redis_script`), ``maxmemory`` as ``deltaserve
    up``'s local redis-server, allkeys-lru, no RDB or AOF."""
    mib = config.cache.local_redis_maxmemory_mib
    container = {"name": "redis", "image": REDIS_IMAGE, "command": ["sh", "-c", redis_script(mib)],
                 "env": [n.secret_env("REDIS_PASSWORD", n.REDIS_SECRET, "password")],
                 "ports": [{"name": "redis", "containerPort": n.REDIS_PORT, "protocol": "TCP"}],
                 "resources": _resources("250m", f"{mib + 256}Mi", "1"),
                 "readinessProbe": n.exec_probe(redis_probe(), period_s=5),
                 "livenessProbe": n.tcp_probe("redis", delay_s=10),
                 "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                 "securityContext": n.container_security()}
    spec = {"securityContext": n.pod_security(999), "containers": [container],
            "volumes": [{"name": "data", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]}
    return [n.service_account(n.REDIS, n.REDIS), deployment(n.REDIS, n.REDIS, spec, recreate=True),
            n.service(n.REDIS, n.REDIS, {"redis": n.REDIS_PORT})]


def collector_health_port(config_text: str) -> int | None:
    """The port of the collector config's ``health_check`` extension when the service enables it."""
    config = yaml.safe_load(config_text) or {}
    if "health_check" not in (config.get("service") or {}).get("extensions", []):
        return None
    endpoint = ((config.get("extensions") or {}).get("health_check") or {}).get("endpoint", "0.0.0.0:13133")
    return int(str(endpoint).rsplit(":", 1)[1])


def collector(addons: Addons, config_text: str) -> list[dict]:
    """The OTel Collector with ``config_text`` (ops/otel/collector.yaml; ConfigMap COLLECTOR_CONFIG, key
    config.yaml), which reads Tempo's address from $TEMPO_OTLP_ENDPOINT. Probes: its health_check
    extension where the config enables one, else the OTLP/gRPC port."""
    ports = {"otlp-grpc": n.OTLP_GRPC_PORT, "otlp-http": n.OTLP_HTTP_PORT}
    health = collector_health_port(config_text)
    if health is not None:
        ports["health"] = health
        ready, live = n.http_probe("/", "health"), n.http_probe("/", "health", delay_s=15)
    else:
        ready, live = n.tcp_probe("otlp-grpc"), n.tcp_probe("otlp-grpc", delay_s=15)
    container = {"name": "otel-collector", "image": COLLECTOR_IMAGE, "args": ["--config=/etc/otelcol/config.yaml"],
                 # the config's memory_limiter refuses data at 400 MiB: below Go's soft limit, below the container's
                 "env": n.env({"GOMEMLIMIT": "460MiB", "TEMPO_OTLP_ENDPOINT": f"{n.TEMPO}:{n.OTLP_GRPC_PORT}"}),
                 "ports": [{"name": k, "containerPort": p, "protocol": "TCP"} for k, p in ports.items()],
                 "resources": _resources("100m", "576Mi", "1"),
                 "readinessProbe": ready, "livenessProbe": live,
                 "volumeMounts": [{"name": "config", "mountPath": "/etc/otelcol", "readOnly": True}],
                 "securityContext": n.container_security()}
    spec = {"securityContext": n.pod_security(10001), "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": COLLECTOR_CONFIG}}]}
    return [n.service_account(n.COLLECTOR, n.COLLECTOR),
            deployment(n.COLLECTOR, n.COLLECTOR, spec, replicas=addons.collector_replicas),
            n.service(n.COLLECTOR, n.COLLECTOR, {"otlp-grpc": n.OTLP_GRPC_PORT, "otlp-http": n.OTLP_HTTP_PORT})]


def tempo_config(addons: Addons) -> str:
    """Tempo's single-binary config: OTLP/gRPC in, blocks on the pod's disk for ``tempo_retention``."""
    return yaml.safe_dump({
        "server": {"http_listen_port": n.TEMPO_HTTP_PORT},
        "distributor": {"receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"0.0.0.0:{n.OTLP_GRPC_PORT}"}}}}},
        "compactor": {"compaction": {"block_retention": addons.tempo_retention}},
        "storage": {"trace": {"backend": "local", "wal": {"path": "/var/tempo/wal"},
                              "local": {"path": "/var/tempo/blocks"}}},
        "usage_report": {"reporting_enabled": False}}, sort_keys=False)


def tempo(addons: Addons) -> list[dict]:
    container = {"name": "tempo", "image": TEMPO_IMAGE, "args": ["-config.file=/etc/tempo/tempo.yaml"],
                 "ports": [{"name": "http", "containerPort": n.TEMPO_HTTP_PORT, "protocol": "TCP"},
                           {"name": "otlp-grpc", "containerPort": n.OTLP_GRPC_PORT, "protocol": "TCP"}],
                 "resources": _resources("100m", "1Gi", "1"),
                 "readinessProbe": n.http_probe("/ready", "http", delay_s=15),
                 "livenessProbe": n.tcp_probe("http", delay_s=15),
                 "volumeMounts": [{"name": "config", "mountPath": "/etc/tempo", "readOnly": True},
                                  {"name": "data", "mountPath": "/var/tempo"}],
                 "securityContext": n.container_security()}
    spec = {"securityContext": n.pod_security(10001), "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": TEMPO_CONFIG}},
                        {"name": "data", "emptyDir": {"sizeLimit": "10Gi"}}]}
    return [n.service_account(n.TEMPO, n.TEMPO), deployment(n.TEMPO, n.TEMPO, spec, recreate=True),
            n.service(n.TEMPO, n.TEMPO, {"http": n.TEMPO_HTTP_PORT, "otlp-grpc": n.OTLP_GRPC_PORT})]


def grafana(dashboards: dict[str, str], dashboards_path: str) -> list[dict]:
    """Grafana with its provisioned datasources and dashboard provider (ops/grafana/provisioning) and
    ``dashboards`` (ConfigMap name → the JSON file it holds), all projected into ``dashboards_path``
    (the provider's path)."""
    mounts = [{"name": "data", "mountPath": "/var/lib/grafana"}, {"name": "tmp", "mountPath": "/tmp"},
              {"name": "datasources", "mountPath": "/etc/grafana/provisioning/datasources", "readOnly": True},
              {"name": "providers", "mountPath": "/etc/grafana/provisioning/dashboards", "readOnly": True}]
    volumes = [{"name": "data", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
               {"name": "datasources", "configMap": {"name": GRAFANA_DATASOURCES}},
               {"name": "providers", "configMap": {"name": GRAFANA_PROVIDERS}}]
    if dashboards:
        mounts.append({"name": "dashboards", "mountPath": dashboards_path, "readOnly": True})
        volumes.append({"name": "dashboards", "projected": {"sources": [
            {"configMap": {"name": cm, "items": [{"key": key, "path": key}]}} for cm, key in dashboards.items()]}})
    plain = {"GF_PATHS_DATA": "/var/lib/grafana", "GF_PATHS_PROVISIONING": "/etc/grafana/provisioning",
             "GF_ANALYTICS_REPORTING_ENABLED": "false", "GF_ANALYTICS_CHECK_FOR_UPDATES": "false",
             "GF_ANALYTICS_CHECK_FOR_PLUGIN_UPDATES": "false", "GF_AUTH_ANONYMOUS_ENABLED": "false",
             "GF_USERS_ALLOW_SIGN_UP": "false",
             "GF_LOG_MODE": "console"}  # no log file: the root filesystem is read-only
    container = {"name": "grafana", "image": GRAFANA_IMAGE,
                 "env": [n.secret_env("GF_SECURITY_ADMIN_USER", n.GRAFANA_SECRET, "admin-user"),
                         n.secret_env("GF_SECURITY_ADMIN_PASSWORD", n.GRAFANA_SECRET, "admin-password")] + n.env(plain),
                 "ports": [{"name": "http", "containerPort": n.GRAFANA_PORT, "protocol": "TCP"}],
                 "resources": _resources("100m", "512Mi", "1"),
                 "readinessProbe": n.http_probe("/api/health", "http"),
                 "livenessProbe": n.http_probe("/api/health", "http", delay_s=30, failures=6),
                 "volumeMounts": mounts, "securityContext": n.container_security()}
    spec = {"securityContext": n.pod_security(472), "containers": [container], "volumes": volumes}
    return [n.service_account(n.GRAFANA, n.GRAFANA), deployment(n.GRAFANA, n.GRAFANA, spec, recreate=True),
            n.service(n.GRAFANA, n.GRAFANA, {"http": n.GRAFANA_PORT})]
