"""Who this process is, as spans, metrics and stats name it (torch-free: the ingress uses it too)."""

from __future__ import annotations

import os
import socket


def replica_id() -> str:
    """Serve's replica id inside a replica, else host:pid."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (in-process use, tests)
        return f"{socket.gethostname()}:{os.getpid()}"
