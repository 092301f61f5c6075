"""The prefill/decode replica's side of the expert pool: each MoE layer's tokens go to the shards
that own their experts (see :mod:`deployments.experts.shard`), and their partial sums come back."""

from __future__ import annotations

import contextlib
import ssl
import threading
import time

import torch

from model.layers.moe import SparseMoE

from deployments.experts.transport import ExpertClient, RemoteExpertError, TransportError
from deployments.observability import metrics

SHARD_COUNTS = ("direct_calls", "handle_calls", "bytes_sent", "bytes_received", "fallbacks")


class ExpertPoolClient:
    """A prefill/decode replica's side of the expert pool: one MoE layer's tokens to the shards.

    ``direct``: persistent :class:`ExpertClient` connections to every replica of each shard it has
    found, used round robin (one per MoE layer call and shard), so a shard's replicas share the
    load. Replicas are found through the shard's handle: ``PROBES`` concurrent ``endpoint()`` calls
    (Serve routes concurrent calls to different replicas) when the shard has no connection, and
    again every ``discovery_s`` in a background thread, so new replicas join within that time. A
    connection that fails is dropped and the call is retried once on another (or a newly resolved)
    replica; if that fails too, the call goes through the handle (no request is lost) and the shard
    stays on the handle path for :attr:`RETRY_DIRECT_AFTER_S`. An error the shard raises is raised
    here, naming shard and layer. Thread-safe: each connection's lock is taken in shard order.

    Per shard it counts calls by transport, tensor bytes sent and received, and fallbacks
    (:meth:`shard_stats`; the replica's metrics export them), and records each call's latency
    (``deltaserve_expert_call_seconds{pool, shard}``: send to reply, one observation per shard and
    MoE layer call). ``pool``: the caller's pool, the metrics' label.
    """

    RETRY_DIRECT_AFTER_S = 5.0
    PROBES = 4

    def __init__(self, shards: list, *, transport: str = "direct", timeout_s: float = 30.0,
                 tls: ssl.SSLContext | None = None, discovery_s: float = 30.0, pool: str = "") -> None:
        if transport not in ("direct", "handle"):
            raise ValueError(f"transport must be 'direct' or 'handle', got {transport!r}")
        if not discovery_s > 0:
            raise ValueError(f"discovery_s must be > 0, got {discovery_s!r}")
        self.shards, self.transport, self.timeout_s, self.tls = shards, transport, timeout_s, tls
        self.discovery_s = discovery_s
        self._conns: list[list[ExpertClient]] = [[] for _ in shards]  # per shard; replaced, never mutated in place
        self._conns_lock = threading.Lock()  # for replacing a shard's list
        self._turn = [0] * len(shards)  # round robin over a shard's connections
        self._down_until = [0.0] * len(shards)
        self._stop = threading.Event()
        self._discoverer: threading.Thread | None = None
        self._stats_lock = threading.Lock()
        # layer_calls / tokens / dispatch_s: MoE layer calls, the tokens they sent, wall seconds inside run()
        self.counts = {"direct_calls": 0, "handle_calls": 0, "reconnects": 0, "fallbacks": 0,
                       "layer_calls": 0, "tokens": 0, "dispatch_s": 0.0}
        self._shard_counts = [dict.fromkeys(SHARD_COUNTS, 0) for _ in shards]
        self._latency = [metrics.bind("deltaserve_expert_call_seconds", pool=pool, shard=str(s)) for s in range(len(shards))]

    def run(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Σ over shards of their experts' weighted outputs: x [T, D], idx [T, k], w [T, k] → [T, D] in x's dtype."""
        t0 = time.perf_counter()
        try:
            return self._run(layer, x, idx, w)
        finally:
            with self._stats_lock:
                self.counts["layer_calls"] += 1
                self.counts["tokens"] += x.shape[0]
                self.counts["dispatch_s"] += time.perf_counter() - t0

    def _run(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.detach().to("cpu", torch.float32)
        parts = [(s, rows, xf[rows].contiguous(), sub_idx, sub_w)
                 for s, rows, sub_idx, sub_w in shard_parts(idx.cpu(), w.detach().to("cpu", torch.float32), len(self.shards))]
        got = self._direct(layer, parts) if self.transport == "direct" else {}
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        for s, rows, xs, sub_idx, sub_w in parts:
            y = got.get(s)
            if y is None:
                t = time.perf_counter()
                y = self.shards[s].run.remote(layer, xs, sub_idx, sub_w).result().to("cpu", torch.float32)
                self._latency[s].observe(time.perf_counter() - t)
                self._count("handle_calls")
                self._count_shard(s, "handle_calls", xs, sub_idx, sub_w, y)
            out.index_add_(0, rows, y)
        return out.to(x.device, x.dtype)

    def stats(self) -> dict:
        with self._stats_lock:
            counts = dict(self.counts)
        return {"transport": self.transport, "shards": len(self.shards),
                "replicas": [len(c) for c in self._conns], **counts}

    def shard_stats(self) -> list[dict[str, int]]:
        """Per shard, since the start: ``direct_calls``, ``handle_calls``, ``bytes_sent``,
        ``bytes_received`` (tensor payload bytes) and ``fallbacks`` (direct calls that fell back to the handle)."""
        with self._stats_lock:
            return [dict(c) for c in self._shard_counts]

    def close(self) -> None:
        self._stop.set()
        for s in range(len(self.shards)):
            for conn in self._conns[s]:
                with conn.lock:
                    self._drop(s, conn)

    def _direct(self, layer: int, parts: list) -> dict[int, torch.Tensor]:
        """Replies of the shards reachable directly: every frame is sent before any reply is read."""
        now = time.monotonic()
        parts = [p for p in parts if self._down_until[p[0]] <= now]
        got: dict[int, torch.Tensor] = {}
        with contextlib.ExitStack() as held:
            sent = []
            for s, _, xs, sub_idx, sub_w in parts:  # ascending shard order: concurrent callers never wait in a cycle
                conn = None
                try:
                    conn = self._pick(s)
                    held.enter_context(conn.lock)
                    t = time.perf_counter()
                    conn.send(layer, xs, sub_idx, sub_w)
                    sent.append((s, conn, xs, sub_idx, sub_w, t))
                except TransportError:
                    if conn is not None:
                        self._drop(s, conn)
            error = None
            for s, conn, xs, sub_idx, sub_w, t in sent:
                try:
                    got[s] = conn.recv(*xs.shape)
                    self._latency[s].observe(time.perf_counter() - t)
                    self._count_shard(s, "direct_calls", xs, sub_idx, sub_w, got[s])
                except RemoteExpertError as e:  # keep reading the other replies: their connections stay in sync
                    error = error or RemoteExpertError(f"expert-pool shard {s} failed on layer {layer}: {e}")
                except TransportError:
                    self._drop(s, conn)
            if error is not None:
                raise error
        for s, _, xs, sub_idx, sub_w in parts:
            if s in got:
                continue
            conn = None
            try:  # another replica, or one resolved again: the replica may have moved
                conn = self._pick(s)
                with conn.lock:
                    t = time.perf_counter()
                    conn.send(layer, xs, sub_idx, sub_w)
                    got[s] = conn.recv(*xs.shape)
                self._latency[s].observe(time.perf_counter() - t)
                self._count_shard(s, "direct_calls", xs, sub_idx, sub_w, got[s])
                self._count("reconnects")
            except RemoteExpertError as e:
                raise RemoteExpertError(f"expert-pool shard {s} failed on layer {layer}: {e}") from None
            except TransportError:
                if conn is not None:
                    self._drop(s, conn)
                self._down_until[s] = time.monotonic() + self.RETRY_DIRECT_AFTER_S
                self._count("fallbacks")
                with self._stats_lock:
                    self._shard_counts[s]["fallbacks"] += 1
        self._count("direct_calls", len(got))
        return got

    def _pick(self, s: int) -> ExpertClient:
        """The next of shard ``s``'s connections (round robin); replicas are resolved if it has none."""
        conns = self._conns[s] or self._discover(s)
        self._turn[s] += 1
        return conns[self._turn[s] % len(conns)]

    def _discover(self, s: int) -> list[ExpertClient]:
        """Resolve shard ``s``'s replicas (``PROBES`` concurrent ``endpoint()`` calls) and connect to the
        new ones; the shard's connections after. TransportError when none can be reached."""
        with self._conns_lock:
            if self._discoverer is None and not self._stop.is_set():
                self._discoverer = threading.Thread(target=self._discover_forever, name="expert-pool-discovery", daemon=True)
                self._discoverer.start()
        endpoints, error = [], None
        try:
            calls = [self.shards[s].endpoint.remote() for _ in range(self.PROBES)]
        except Exception as e:  # e.g. Serve shutting down
            calls, error = [], e
        for call in calls:
            try:
                endpoints.append(call.result(timeout_s=self.timeout_s))
            except Exception as e:  # Ray raises many types here (replica gone, timeout, no endpoint)
                error = e
        known = {c.endpoint for c in self._conns[s]}
        fresh = []
        for endpoint in dict.fromkeys(endpoints):  # distinct, in order
            if endpoint not in known:
                try:
                    fresh.append(ExpertClient(endpoint, timeout_s=self.timeout_s, tls=self.tls))
                except TransportError as e:
                    error = e
        with self._conns_lock:  # another thread may have connected to the same replicas meanwhile
            known = {c.endpoint for c in self._conns[s]}
            if self._stop.is_set():  # closed meanwhile
                known = {c.endpoint for c in fresh}
            extra = [c for c in fresh if c.endpoint in known]
            conns = self._conns[s] = self._conns[s] + [c for c in fresh if c.endpoint not in known]
        for c in extra:
            c.close()
        if not conns:
            raise TransportError(f"cannot reach any replica of expert-pool shard {s}: "
                                 f"{type(error).__name__}: {error}") from error
        return conns

    def _discover_forever(self) -> None:
        """Background: look for new replicas of the shards in use every ``discovery_s``."""
        while not self._stop.wait(self.discovery_s):
            for s in range(len(self.shards)):
                if self._conns[s]:
                    try:
                        self._discover(s)
                    except TransportError:
                        pass  # the next round, or the next call's own resolution, tries again

    def _drop(self, s: int, conn: ExpertClient) -> None:
        with self._conns_lock:
            self._conns[s] = [c for c in self._conns[s] if c is not conn]
        conn.close()

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.counts[key] += n

    def _count_shard(self, s: int, calls: str, xs: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        """One answered call of shard ``s`` over ``calls`` (direct_calls|handle_calls), with its payload bytes."""
        with self._stats_lock:
            c = self._shard_counts[s]
            c[calls] += 1
            c["bytes_sent"] += xs.nbytes + idx.nbytes + w.nbytes
            c["bytes_received"] += y.nbytes


def shard_parts(idx: torch.Tensor, w: torch.Tensor, num_shards: int) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(shard, rows, idx [n, k], w [n, k]) per shard owning one of the rows' experts.

    A row's experts owned by another shard are sent as the shard's own first expert with weight 0:
    their contribution is exactly 0 and a shard only ever runs experts it owns."""
    owner = idx % num_shards  # [T, k]
    out = []
    for s in range(num_shards):
        mine = owner == s
        rows = mine.any(1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        out.append((s, rows, _own_fill(idx[rows], mine[rows]), torch.where(mine[rows], w[rows], torch.zeros_like(w[rows]))))
    return out


def _own_fill(idx: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """Replace experts not owned (mine False) by the row's first owned expert id."""
    first = idx.gather(1, mine.float().argmax(1, keepdim=True))  # [n, 1] an owned expert per row
    return torch.where(mine, idx, first.expand_as(idx))


class RemoteExperts:
    """Drop-in for `run_experts` inside one MoE layer: dispatch through the pool client."""

    def __init__(self, pool: ExpertPoolClient, layer: int) -> None:
        self.pool, self.layer = pool, layer

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts) -> torch.Tensor:
        return self.pool.run(self.layer, x, idx, w)


def attach_expert_pool(model, shards: list, *, transport: str = "direct", timeout_s: float = 30.0,
                       tls: ssl.SSLContext | None = None, discovery_s: float = 30.0, pool: str = "") -> ExpertPoolClient:
    """Route every MoE layer's experts of ``model`` to the shard deployments (handles); one
    :class:`ExpertPoolClient` (connections to every replica of each shard) serves all layers."""
    client = ExpertPoolClient(shards, transport=transport, timeout_s=timeout_s, tls=tls, discovery_s=discovery_s, pool=pool)
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if isinstance(moe, SparseMoE):
            moe.expert_fn = RemoteExperts(client, i)
            moe.experts = torch.nn.ModuleList()  # the replica no longer holds routed experts
    return client
