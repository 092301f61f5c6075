#!/bin/sh
# HAProxy for `deltaserve up` (deployments.cli.up.haproxy_env): Serve runs this in place of the binary
# ($DELTASERVE_HAPROXY_BINARY) with the arguments it would give it, and `exec` keeps this process's pid, which Serve
# tracks and signals. Before the binary runs, the config file (-f) gets:
# - slow clients bounded: a request's headers, and its body up to one buffer (16 KiB), must arrive within
#   $DELTASERVE_HAPROXY_HTTP_REQUEST_TIMEOUT_S seconds (else 408), and HAProxy holds them meanwhile, not an ingress
#   replica (Serve's config sets no `timeout http-request`: `timeout client`, 3600 s, applied);
# - with DELTASERVE_HAPROXY_LOOPBACK=1, the stats page and Prometheus exporter, which Serve binds on every interface
#   (`bind *:PORT`, `bind :PORT`), moved to 127.0.0.1.
# HAProxy gets SIGTERM when the process that started it (Serve's HAProxy manager actor) dies (setpriv --pdeathsig),
# so a platform that is killed leaves no HAProxy holding its ports.
set -eu
prev=""
for arg in "$@"; do
  if [ "$prev" = "-f" ]; then
    if [ "${DELTASERVE_HAPROXY_LOOPBACK:-0}" = 1 ]; then
      sed -i -E 's/^([[:space:]]*bind[[:space:]]+)\*?:([0-9]+)/\1127.0.0.1:\2/' "$arg"
    fi
    if ! grep -q '^    timeout http-request ' "$arg"; then
      sed -i -E "s/^defaults\$/defaults\n    timeout http-request ${DELTASERVE_HAPROXY_HTTP_REQUEST_TIMEOUT_S}s\n    option http-buffer-request/" "$arg"
    fi
  fi
  prev="$arg"
done
if command -v setpriv >/dev/null 2>&1; then
  exec setpriv --pdeathsig TERM -- "$DELTASERVE_HAPROXY_BINARY" "$@"
fi
exec "$DELTASERVE_HAPROXY_BINARY" "$@"
