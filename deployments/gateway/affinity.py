"""Cache-affinity routing, Ray-free: which prefill replica a request should go to because it already
holds the request's state in its cache LRU (``deployments/gateway/routing.py`` is the Serve edge).

A prefill replica keeps every checkpoint and MLA block it computed in its in-replica LRU
(``cache_service/lru.py``) as well as in Redis. A session's next turn, or another request with the
same prefix, resumes on any replica, but only the replica that computed the earlier turn reads it
from memory; any other one fetches it from Redis first (at 16k tokens of k3-tiny history, ~10 MB of
MLA blocks). So:

- the ingress derives :func:`routing_keys` for each request: the session's key (``x-session-id``)
  first, then its prefix's (its first cache block of tokens). Both are salted digests: a key is
  blake2b over the tenant's server-side cache salt (and the client's own salt), so it reveals
  nothing of the session id or the prompt and two tenants never share one;
- the router records, for each key of a request it routed, the replica that took it
  (:meth:`AffinityTable.record`), in a bounded LRU map;
- the next request with a known key goes to that replica (:func:`choose`) when it is among the
  replicas Serve reports running (a dead, unhealthy or removed one never is: no stickiness to
  it) and its queue is below the bound ``max_queue`` (requests it holds, as the router last knew
  them); otherwise the router's default choice (power of two choices) decides, and the request's
  keys then point at wherever it went.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

_DOMAIN = b"deltaserve:affinity:v1"
KEY_BYTES = 16  # digest bytes of a routing key (hex: 32 characters)
AFFINITY_HEADER = "x-deltaserve-affinity"  # "off": this request ignores affinity (benchmarks, diagnostics)


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _key(kind: bytes, tenant_salt: str, client_salt: str | None, data: bytes) -> str:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in (_DOMAIN, tenant_salt.encode(), (client_salt or "").encode(), kind, data):
        h.update(_field(part))
    return h.hexdigest()


def routing_keys(*, tenant_salt: str, client_salt: str | None, session_id: str | None, prompt_ids: Sequence[int],
                 block_size: int) -> tuple[str, ...]:
    """A request's affinity keys, most specific first: its session's (when it names one), then its
    prefix's (its first ``block_size`` tokens, when the prompt is longer than that: a cache lookup
    only ever resumes full blocks of ``prompt[:-1]``). Empty when the tenant has no cache salt (its
    requests do not use the cache, so no replica holds anything of theirs)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if not tenant_salt:
        return ()
    keys = []
    if session_id:
        keys.append(_key(b"session", tenant_salt, client_salt, session_id.encode("utf-8", "surrogatepass")))
    if len(prompt_ids) > block_size:
        keys.append(_key(b"prefix", tenant_salt, client_salt, struct.pack(f"<{block_size}I", *prompt_ids[:block_size])))
    return tuple(keys)


def parse_affinity_header(value: str | None) -> bool:
    """Whether a request uses affinity, from its ``x-deltaserve-affinity`` header or gRPC metadata
    (absent or ``on``: yes; ``off``: no; case-insensitive); ValueError naming anything else."""
    if value is None or value.strip().lower() == "on":
        return True
    if value.strip().lower() == "off":
        return False
    raise ValueError(f"{AFFINITY_HEADER} must be 'on' or 'off', got {value[:40]!r}")


class AffinityTable:
    """Routing key → the replica that last took a request with it; at most ``max_keys`` keys, the
    least recently recorded or used dropped first. Thread-safe (Serve may run the router on its own
    event loop while replica updates arrive)."""

    def __init__(self, max_keys: int) -> None:
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"max_keys must be a positive integer, got {max_keys!r}")
        self.max_keys = max_keys
        self._owner: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, keys: Iterable[str], replica: str) -> None:
        """``replica`` took a request with ``keys``: it now holds their state."""
        with self._lock:
            for key in keys:
                self._owner[key] = replica
                self._owner.move_to_end(key)
            while len(self._owner) > self.max_keys:
                self._owner.popitem(last=False)

    def owner(self, key: str) -> str | None:
        with self._lock:
            replica = self._owner.get(key)
            if replica is not None:
                self._owner.move_to_end(key)
            return replica

    def forget_replica(self, replica: str) -> int:
        """Drop every key of ``replica`` (it died or left); how many."""
        return self._drop(lambda r: r == replica)

    def retain(self, live: Iterable[str]) -> int:
        """Drop the keys of every replica not in ``live``; how many."""
        alive = set(live)
        return self._drop(lambda r: r not in alive)

    def _drop(self, doomed_replica) -> int:
        with self._lock:
            doomed = [k for k, r in self._owner.items() if doomed_replica(r)]
            for k in doomed:
                del self._owner[k]
            return len(doomed)

    def __len__(self) -> int:
        return len(self._owner)


def choose(table: AffinityTable, keys: Sequence[str], queue_lens: Mapping[str, int | None], max_queue: int) -> str | None:
    """The replica a request with ``keys`` should go to, or None for the default choice.

    ``queue_lens``: every replica that may take the request now (Serve's running, healthy replicas)
    → the requests it holds as the router last heard (None: not known lately; the router then probes
    it and asks again). The first key with a recorded owner among them decides: its owner when that
    owner's queue is below ``max_queue`` (or unknown), else None (an overloaded owner is not waited for, and a less specific key does not
    send the request to another replica: its owner holds a shorter prefix of the same state at best).
    A key whose owner is not among ``queue_lens`` (dead, removed, unhealthy) is passed over."""
    for key in keys:
        replica = table.owner(key)
        if replica is None or replica not in queue_lens:
            continue
        q = queue_lens[replica]
        return replica if q is None or q < max_queue else None
    return None
