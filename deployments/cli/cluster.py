"""Joining the platform's Ray cluster from a command (`deltaserve ops`, `cache`, `usage`)."""

from __future__ import annotations

import os


class PlatformUnreachable(RuntimeError):
    """No Ray cluster answers where the platform should run (the command says how to point it at one)."""


def join_cluster(address: str | None = None) -> None:
    """Join the cluster at ``address`` (default $RAY_ADDRESS, else this machine's) as a quiet driver, once per
    process; PlatformUnreachable when none runs there. (Ray raises ConnectionError, which the commands keep for a
    Redis that does not answer.)"""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False,
                 logging_level="ERROR")
    except ConnectionError as e:
        raise PlatformUnreachable(str(e)) from None
