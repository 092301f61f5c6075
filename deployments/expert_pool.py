"""Expert pool: routed experts sharded over Serve deployments by expert id (attention–FFN split).

Shard ``s`` of ``S`` owns experts ``e`` with ``e % S == s`` in every MoE layer. A prefill or
decode replica in pool mode keeps attention, router, shared experts and the latent
projections, and for each MoE layer sends the step's tokens (all sequences of the batch
together) to every shard owning one of their chosen experts, all shards first, then reads
the replies, and sums the partial outputs. Weights of experts a shard does not own are zeroed
on the way, so each token's result equals the colocated path's. A shard keeps only its own
experts' weights (1/S of the routed experts; the rest of the model is dropped after loading).

Serve is the control plane (placement, restarts, ``endpoint()``); the data plane is either a
persistent TCP connection per shard (``expert_transport: direct``, :mod:`.expert_transport`) or
a Serve handle call per layer and shard (``handle``: the reference, and the fallback of
``direct`` when a connection cannot be re-established).
"""

from __future__ import annotations

import contextlib
import ssl
import threading
import time
import weakref

import torch

from model.layers.moe import SparseMoE, run_experts

from .config import PlatformConfig
from .expert_transport import (ExpertClient, ExpertEndpoint, ExpertServer, FrameLimits, RemoteExpertError, TransportError,
                               ssl_context)
from .replica import load_replica_model, replica_id


class ExpertShard:
    """Holds the experts of one shard; `run` (handle) and the data-plane server compute their
    weighted sum for a batch of tokens."""

    def __init__(self, config: PlatformConfig, shard: int, num_shards: int) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
        self.shard, self.num_shards = shard, num_shards
        # per MoE layer, the owned experts by local id e // S (the rest of the model is freed here)
        self.local, self.num_experts, dim = _owned_experts(load_replica_model(config)[0], shard, num_shards)
        self.replica = replica_id()
        self._lock = threading.Lock()
        self.counts = {"direct_calls": 0, "handle_calls": 0, "tokens": 0, "compute_s": 0.0}  # compute_s: in run_experts
        self.server: ExpertServer | None = None
        if config.expert_transport == "direct":
            run = weakref.WeakMethod(self._run_direct)  # the server's threads must not keep the shard alive

            def handler(layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                fn = run()
                if fn is None:
                    raise RuntimeError("expert shard is gone")
                return fn(layer, x, idx, w)

            host = config.expert_transport_host
            port = config.expert_transport_port + shard if config.expert_transport_port else 0
            self.server = ExpertServer(handler, FrameLimits(dim=dim, layers=frozenset(self.local)), host=host, port=port,
                                       advertise_host=_advertised_host(host), io_timeout_s=config.expert_transport_timeout_s,
                                       tls=tls_context(config, server_side=True))
            self._finalizer = weakref.finalize(self, self.server.close)  # also at interpreter exit

    def endpoint(self) -> ExpertEndpoint:
        """Where this replica's data plane listens (host, port, secret token)."""
        if self.server is None:
            raise RuntimeError(f"expert-pool shard {self.shard} runs with expert_transport 'handle': no direct endpoint")
        return self.server.endpoint

    def run(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The handle path: Σ_j w[t,j] · expert idx[t,j] (x[t]).

        x [n, D] fp32, idx [n, k] global expert ids (all owned by this shard), w [n, k] fp32 (0 where
        another shard owns the expert) → [n, D] fp32."""
        return self._run(layer, x, idx, w, "handle_calls")

    def _run_direct(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._run(layer, x, idx, w, "direct_calls")

    @torch.inference_mode()
    def _run(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, via: str) -> torch.Tensor:
        if layer not in self.local:
            raise ValueError(f"layer {layer} has no routed experts (MoE layers: {sorted(self.local)})")
        if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < self.num_experts):
            raise ValueError(f"expert ids must be in 0..{self.num_experts - 1}, got {int(idx.min())}..{int(idx.max())}")
        own = (idx % self.num_shards) == self.shard
        if not bool(own.all()):
            raise ValueError(f"shard {self.shard} got tokens routed to experts it does not own")
        t = time.perf_counter()
        # The [n, k] layout of the colocated call, on the owned experts renumbered e // S; run_experts
        # picks its path by assignments vs experts (paths round differently) as for the whole layer.
        out = run_experts(x, idx // self.num_shards, w, self.local[layer], path_experts=self.num_experts)
        with self._lock:
            self.counts[via] += 1
            self.counts["tokens"] += x.shape[0]
            self.counts["compute_s"] += time.perf_counter() - t
        return out

    def stats(self) -> dict:
        with self._lock:
            counts = dict(self.counts)
        return {"replica": self.replica, "shard": self.shard, "calls": counts["direct_calls"] + counts["handle_calls"],
                **counts, "transport": "direct" if self.server else "handle"}

    def close(self) -> None:
        """Stop the data-plane server (idempotent; also when the shard is collected or at exit)."""
        if getattr(self, "server", None) is not None:  # __init__ may have failed before the server
            self._finalizer()

    def __del__(self) -> None:  # Serve calls it when the replica shuts down
        self.close()


def _owned_experts(model, shard: int, num_shards: int) -> tuple[dict[int, torch.nn.ModuleList], int, int]:
    """({MoE layer: its experts e with e % S == shard, in order}, experts per layer, the experts' input width)."""
    num_experts, dim = model.config.num_experts, model.config.hidden_size
    local = {}
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if isinstance(moe, SparseMoE):
            local[i] = torch.nn.ModuleList(moe.experts[e] for e in range(shard, num_experts, num_shards))
            dim = moe.latent or dim
    return local, num_experts, dim


def tls_context(config: PlatformConfig, *, server_side: bool) -> ssl.SSLContext | None:
    """The data plane's TLS context of one side from ``config.expert_transport_tls`` (None: plain TCP)."""
    t = config.expert_transport_tls
    return None if t is None else ssl_context(t.cert_file, t.key_file, t.ca_file, server_side=server_side)


def _advertised_host(host: str) -> str:
    """The address clients dial: ``host``, or this node's IP when binding every interface."""
    if host not in ("0.0.0.0", ""):
        return host
    import ray.util

    return ray.util.get_node_ip_address()


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
    """

    RETRY_DIRECT_AFTER_S = 5.0
    PROBES = 4

    def __init__(self, shards: list, *, transport: str = "direct", timeout_s: float = 30.0,
                 tls: ssl.SSLContext | None = None, discovery_s: float = 30.0) -> None:
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
                y = self.shards[s].run.remote(layer, xs, sub_idx, sub_w).result().to("cpu", torch.float32)
                self._count("handle_calls")
            out.index_add_(0, rows, y)
        return out.to(x.device, x.dtype)

    def stats(self) -> dict:
        with self._stats_lock:
            counts = dict(self.counts)
        return {"transport": self.transport, "shards": len(self.shards),
                "replicas": [len(c) for c in self._conns], **counts}

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
                    conn.send(layer, xs, sub_idx, sub_w)
                    sent.append((s, conn, xs))
                except TransportError:
                    if conn is not None:
                        self._drop(s, conn)
            error = None
            for s, conn, xs in sent:
                try:
                    got[s] = conn.recv(*xs.shape)
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
                    conn.send(layer, xs, sub_idx, sub_w)
                    got[s] = conn.recv(*xs.shape)
                self._count("reconnects")
            except RemoteExpertError as e:
                raise RemoteExpertError(f"expert-pool shard {s} failed on layer {layer}: {e}") from None
            except TransportError:
                if conn is not None:
                    self._drop(s, conn)
                self._down_until[s] = time.monotonic() + self.RETRY_DIRECT_AFTER_S
                self._count("fallbacks")
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
                       tls: ssl.SSLContext | None = None, discovery_s: float = 30.0) -> ExpertPoolClient:
    """Route every MoE layer's experts of ``model`` to the shard deployments (handles); one
    :class:`ExpertPoolClient` (connections to every replica of each shard) serves all layers."""
    pool = ExpertPoolClient(shards, transport=transport, timeout_s=timeout_s, tls=tls, discovery_s=discovery_s)
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if isinstance(moe, SparseMoE):
            moe.expert_fn = RemoteExperts(pool, i)
            moe.experts = torch.nn.ModuleList()  # the replica no longer holds routed experts
    return pool
