#!/bin/sh
# HAProxy for `deltaserve up` on a loopback host (deployments.cli.up.haproxy_env): Serve's HAProxy mode writes a
# config whose stats page and Prometheus exporter bind every interface (`bind *:PORT`, `bind :PORT`); the platform
# listens on 127.0.0.1 unless told otherwise, so those binds are moved to 127.0.0.1 before the real binary
# ($DELTASERVE_HAPROXY_BINARY) runs. `exec` keeps this process's pid, which Serve tracks and signals.
set -eu
prev=""
for arg in "$@"; do
  if [ "$prev" = "-f" ]; then
    sed -i -E 's/^([[:space:]]*bind[[:space:]]+)\*?:([0-9]+)/\1127.0.0.1:\2/' "$arg"
  fi
  prev="$arg"
done
exec "$DELTASERVE_HAPROXY_BINARY" "$@"
