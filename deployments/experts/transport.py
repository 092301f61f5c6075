"""The expert pool's data plane: one MoE layer's tokens to a shard and its partial output back,
over a persistent TCP connection (Serve stays the control plane: it places the shards and hands
out their :class:`ExpertEndpoint`).

Wire format (little-endian, no pickle; every header field is checked before any body is read)::

    client ─► HELLO  header(type=HELLO, n=TOKEN_BYTES)  token bytes          once per connection
           ◄─ reply  header(status OK | ERROR)          [error text]         ERROR: server closes
    client ─► RUN    header(type=RUN, layer, n, D, k, dtypes)
                     x fp32 [n, D] · idx int64 [n, k] · w fp32 [n, k]        raw, C order
           ◄─ reply  header(status OK, n, D, nbytes)    out fp32 [n, D]
                  or header(status ERROR, nbytes)       UTF-8 message        the shard raised

A malformed frame (bad magic, version, type, dtype, layer or size) gets an ERROR reply naming the
field, then the server closes the connection: the stream cannot be trusted to be in sync.

Before the token is checked a connection costs the server as little as possible: at most
``max_connections`` connections are open and at most ``max_unauthenticated`` of them have not yet
passed the HELLO; one over either bound is closed as soon as it is accepted, before a thread or a
byte is spent on it. A connection must complete its TLS handshake and HELLO (a fixed 28 + 32
bytes) within ``hello_timeout_s`` in all, or it is closed: a peer trickling bytes cannot hold a
slot for longer.
An error raised by the handler on a well-formed frame keeps the connection open.

With :func:`ssl_context` (``PlatformConfig.expert_transport_tls``) every connection is mutual TLS
before the HELLO: the frames above travel encrypted, and a peer needs a certificate the
cluster's CA signed as well as the replica's token. A server with TLS takes no plain
connection and a client with TLS opens none (the endpoint says which the server takes).

Plain classes (sockets and threads), testable without Ray.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from deployments.config import PlatformConfig

MAGIC = b"DSXP"
VERSION = 1
MSG_HELLO, MSG_RUN = 1, 2
STATUS_OK, STATUS_ERROR = 0, 1
DTYPE_F32, DTYPE_I64 = 1, 2
TOKEN_BYTES = 32

# magic, version, type, layer, n, D, k, x dtype, idx dtype, w dtype, pad  (28 bytes)
REQUEST = struct.Struct("<4sHHiIIIBBBx")
# magic, version, status, n, D, nbytes  (24 bytes)
REPLY = struct.Struct("<4sHHIIQ")


class FrameError(ValueError):
    """A frame breaks the protocol; the message names the offending field and value."""


class TransportError(ConnectionError):
    """The connection failed or the peer broke the protocol; retry on a new connection."""


class RemoteExpertError(RuntimeError):
    """The shard received a well-formed frame and raised; the message is the shard's."""


@dataclass(frozen=True)
class ExpertEndpoint:
    """Where one shard replica's data plane listens (from ``ExpertShard.endpoint()``)."""

    host: str  # address clients connect to
    port: int  # TCP port
    token: str  # per-replica secret, hex (TOKEN_BYTES bytes); sent once per connection
    tls: bool = False  # the server takes only TLS connections (see ssl_context)


def ssl_context(cert_file: str, key_file: str, ca_file: str, *, server_side: bool) -> ssl.SSLContext:
    """Mutual TLS for one side of the data plane, as Ray's own ``RAY_USE_TLS``: every replica presents
    ``cert_file`` (with ``key_file``) and takes only peers whose certificate ``ca_file`` signed; TLS 1.2 or
    later. Endpoints are IP addresses that move with the replicas, so the peer's name is not checked, only
    the CA's signature. ValueError naming a file that is missing or does not load."""
    for what, path in (("cert_file", cert_file), ("key_file", key_file), ("ca_file", ca_file)):
        if not os.path.isfile(path):
            raise ValueError(f"expert transport TLS {what} {path!r} is not a file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"expert transport TLS cert_file {cert_file!r} / key_file {key_file!r} do not load: {e}") from e
    try:
        ctx.load_verify_locations(ca_file)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"expert transport TLS ca_file {ca_file!r} does not load: {e}") from e
    return ctx


@dataclass(frozen=True)
class FrameLimits:
    """Bounds a server puts on a RUN frame before allocating anything."""

    dim: int  # D: the experts' input width (the only accepted value)
    layers: frozenset[int]  # layers with routed experts on this server
    max_k: int = 64  # experts per token
    max_frame_bytes: int = 256 << 20  # body bytes of one RUN frame
    max_error_bytes: int = 64 << 10  # error message bytes (longer messages are cut)


@dataclass(frozen=True)
class RunHeader:
    """A RUN frame's header: ``layer`` and the shapes of x [n, D], idx [n, k], w [n, k]."""

    layer: int
    n: int
    D: int
    k: int

    @property
    def body_bytes(self) -> int:
        return self.n * (4 * self.D + 12 * self.k)

    def pack(self) -> bytes:
        return REQUEST.pack(MAGIC, VERSION, MSG_RUN, self.layer, self.n, self.D, self.k, DTYPE_F32, DTYPE_I64, DTYPE_F32)


def _check_common(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise FrameError(f"magic: expected {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise FrameError(f"version: expected {VERSION}, got {version}")


def parse_request(buf: bytes) -> tuple[int, tuple]:
    """(type, fields) of a request header; checks magic, version and type only."""
    magic, version, kind, *fields = REQUEST.unpack(buf)
    _check_common(magic, version)
    if kind not in (MSG_HELLO, MSG_RUN):
        raise FrameError(f"type: expected {MSG_HELLO} (HELLO) or {MSG_RUN} (RUN), got {kind}")
    return kind, tuple(fields)


def check_hello(fields: tuple) -> None:
    layer, n, D, k, *dtypes = fields
    if n != TOKEN_BYTES:
        raise FrameError(f"n: a HELLO carries a {TOKEN_BYTES}-byte token, got n={n}")
    if (layer, D, k, *dtypes) != (0, 0, 0, 0, 0, 0):
        raise FrameError(f"HELLO: layer, D, k and dtypes must be 0, got {(layer, D, k, *dtypes)}")


def check_run(fields: tuple, limits: FrameLimits) -> RunHeader:
    """The :class:`RunHeader` of a RUN frame's fields, every field within ``limits``."""
    layer, n, D, k, x_dtype, idx_dtype, w_dtype = fields
    for name, got, want in (("x dtype", x_dtype, DTYPE_F32), ("idx dtype", idx_dtype, DTYPE_I64), ("w dtype", w_dtype, DTYPE_F32)):
        if got != want:
            raise FrameError(f"{name}: expected code {want}, got {got}")
    if layer not in limits.layers:
        raise FrameError(f"layer: {layer} has no routed experts here (MoE layers: {sorted(limits.layers)})")
    if D != limits.dim:
        raise FrameError(f"D: expected {limits.dim}, got {D}")
    if not 1 <= k <= limits.max_k:
        raise FrameError(f"k: expected 1..{limits.max_k}, got {k}")
    head = RunHeader(layer, n, D, k)
    if n < 1 or head.body_bytes > limits.max_frame_bytes:
        raise FrameError(f"n: {n} tokens ({head.body_bytes} body bytes) is outside 1 token..{limits.max_frame_bytes} bytes")
    return head


def parse_reply(buf: bytes) -> tuple[int, int, int, int]:
    """(status, n, D, nbytes) of a reply header; a bad magic, version or status is a TransportError."""
    magic, version, status, n, D, nbytes = REPLY.unpack(buf)
    try:
        _check_common(magic, version)
    except FrameError as e:
        raise TransportError(f"bad reply header: {e}") from None
    if status not in (STATUS_OK, STATUS_ERROR):
        raise TransportError(f"bad reply header: status {status}")
    return status, n, D, nbytes


def ok_reply(n: int = 0, D: int = 0) -> bytes:
    return REPLY.pack(MAGIC, VERSION, STATUS_OK, n, D, 4 * n * D)


def error_reply(message: str, limit: int) -> list[bytes]:
    text = message.encode("utf-8", "replace")[:limit]
    return [REPLY.pack(MAGIC, VERSION, STATUS_ERROR, 0, 0, len(text)), text]


def _bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    return memoryview(t.numpy()).cast("B")


def send_all(sock: socket.socket, buffers: list) -> None:
    """Write ``buffers`` in order: scatter-gather sends on a plain socket (no concatenation copy), one joined
    write through TLS (an SSLSocket has no ``sendmsg``)."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    if isinstance(sock, ssl.SSLSocket):  # no scatter-gather through TLS: one copy, then one write (fewer records)
        sock.sendall(b"".join(views))
        return
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; a closed peer is a TransportError."""
    got = 0
    while got < len(view):
        r = sock.recv_into(view[got:])
        if r == 0:
            raise TransportError("connection closed by peer")
        got += r


def _recv_by(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """:func:`recv_into` that also ends at ``deadline`` (monotonic seconds) with TimeoutError, however
    the peer paces its bytes."""
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the handshake did not complete in time")
        sock.settimeout(left)
        r = sock.recv_into(view[got:])
        if r == 0:
            raise TransportError("connection closed by peer")
        got += r


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def encode_run(layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> list:
    """Header + body buffers of a RUN frame. x [n, D] fp32, idx [n, k] int64, w [n, k] fp32."""
    if x.dim() != 2 or idx.dim() != 2 or idx.shape[0] != x.shape[0] or w.shape != idx.shape:
        raise ValueError(f"shapes: x {tuple(x.shape)}, idx {tuple(idx.shape)}, w {tuple(w.shape)} (want [n, D], [n, k], [n, k])")
    if (x.dtype, idx.dtype, w.dtype) != (torch.float32, torch.int64, torch.float32):
        raise ValueError(f"dtypes: x {x.dtype}, idx {idx.dtype}, w {w.dtype} (want float32, int64, float32)")
    n, D = x.shape
    parts = [t.detach().cpu().contiguous() for t in (x, idx, w)]
    return [RunHeader(layer, n, D, idx.shape[1]).pack(), *(_bytes(t) for t in parts)]


Handler = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertServer:
    """Serves RUN frames with ``handler(layer, x, idx, w) -> out [n, D]`` on a TCP socket.

    One daemon thread accepts, one per connection serves frames in order. ``token`` (hex) is
    generated when not given; :meth:`close` stops accepting and closes every connection.
    ``max_connections``, ``max_unauthenticated`` and ``hello_timeout_s`` bound what a peer without
    the token can hold (see the module docstring); a client replica keeps one connection per shard
    replica, so the defaults leave room for hundreds of replicas.
    """

    def __init__(self, handler: Handler, limits: FrameLimits, *, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, token: str | None = None, io_timeout_s: float = 30.0,
                 tls: ssl.SSLContext | None = None, max_connections: int = 512, max_unauthenticated: int = 32,
                 hello_timeout_s: float = 5.0) -> None:
        if not 1 <= max_unauthenticated <= max_connections:
            raise ValueError(f"need 1 <= max_unauthenticated <= max_connections, got {max_unauthenticated} and "
                             f"{max_connections}")
        if not hello_timeout_s > 0:
            raise ValueError(f"hello_timeout_s must be > 0, got {hello_timeout_s!r}")
        self.handler, self.limits, self.io_timeout_s = handler, limits, io_timeout_s
        self.max_connections, self.max_unauthenticated = max_connections, max_unauthenticated
        self.hello_timeout_s = hello_timeout_s
        self._tls = tls  # server-side context (ssl_context(..., server_side=True)): every connection handshakes first
        self._token = bytes.fromhex(token) if token else secrets.token_bytes(TOKEN_BYTES)
        if len(self._token) != TOKEN_BYTES:
            raise ValueError(f"token must be {TOKEN_BYTES} bytes, got {len(self._token)}")
        self._listener = socket.create_server((host, port))
        self.endpoint = ExpertEndpoint(advertise_host or host, self._listener.getsockname()[1], self._token.hex(), tls is not None)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._unauthenticated = 0  # open connections that have not passed the HELLO yet
        self.frames = 0  # RUN frames answered OK
        self.rejected = 0  # connections closed for a bad token or a malformed frame
        self.refused = 0  # connections closed on accept: over max_connections or max_unauthenticated
        self.timed_out = 0  # connections closed for not completing TLS + HELLO within hello_timeout_s
        threading.Thread(target=self._accept, name=f"expert-server:{self.endpoint.port}", daemon=True).start()

    def close(self) -> None:
        """Stop accepting and close every connection (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for s in (self._listener, *conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                full = len(self._conns) >= self.max_connections or self._unauthenticated >= self.max_unauthenticated
                if full:
                    self.refused += 1
                else:
                    self._conns.add(conn)
                    self._unauthenticated += 1
            if full:
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="expert-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(REQUEST.size)
        authenticated = False
        deadline = time.monotonic() + self.hello_timeout_s
        try:
            conn.settimeout(self.hello_timeout_s)
            if self._tls is not None:
                raw = conn
                conn = self._tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
                with self._lock:
                    self._conns.discard(raw)
                    if self._closed:
                        return
                    self._conns.add(conn)
                try:  # here, not in wrap_socket, so that a failed handshake is counted before the socket closes
                    conn.do_handshake()
                except TimeoutError:
                    self.timed_out += 1
                    return
                except OSError:  # not TLS, or a peer certificate the CA did not sign (SSLError)
                    self.rejected += 1
                    return
            try:
                if not self._hello(conn, head, deadline):
                    return
            except TimeoutError:
                self.timed_out += 1
                return
            authenticated = True
            with self._lock:  # before the OK: a client that has its OK is no longer counted as unauthenticated
                self._unauthenticated -= 1
            conn.sendall(ok_reply())
            while True:
                conn.settimeout(None)  # idle between frames for as long as the client likes
                if conn.recv_into(head, 1) == 0:
                    return
                conn.settimeout(self.io_timeout_s)
                recv_into(conn, memoryview(head)[1:])
                try:
                    kind, fields = parse_request(bytes(head))
                    if kind != MSG_RUN:
                        raise FrameError(f"type: expected {MSG_RUN} (RUN) after the handshake, got {kind}")
                    frame = check_run(fields, self.limits)
                except FrameError as e:
                    self._reject(conn, f"bad frame: {e}")
                    return
                self._run(conn, frame)
        except (OSError, TransportError):
            return  # the client went away or stalled: nothing to answer
        finally:
            with self._lock:
                self._conns.discard(conn)
                if not authenticated:
                    self._unauthenticated -= 1
            conn.close()

    def _hello(self, conn: socket.socket, head: bytearray, deadline: float) -> bool:
        """Read and check the HELLO and its token by ``deadline`` (TimeoutError past it); the caller sends the OK."""
        _recv_by(conn, memoryview(head), deadline)
        try:
            kind, fields = parse_request(bytes(head))
            if kind != MSG_HELLO:
                raise FrameError(f"type: expected {MSG_HELLO} (HELLO) first, got {kind}")
            check_hello(fields)
        except FrameError as e:
            self._reject(conn, f"bad handshake: {e}")
            return False
        token = bytearray(TOKEN_BYTES)
        _recv_by(conn, memoryview(token), deadline)
        if not hmac.compare_digest(bytes(token), self._token):
            self._reject(conn, "bad token")
            return False
        return True

    def _run(self, conn: socket.socket, h: RunHeader) -> None:
        x = torch.empty(h.n, h.D, dtype=torch.float32)
        idx = torch.empty(h.n, h.k, dtype=torch.int64)
        w = torch.empty(h.n, h.k, dtype=torch.float32)
        for t in (x, idx, w):
            recv_into(conn, _bytes(t))
        try:
            out = self.handler(h.layer, x, idx, w)
            if out.shape != (h.n, h.D):
                raise RuntimeError(f"handler returned shape {tuple(out.shape)} for [n, D] = [{h.n}, {h.D}] (a bug in the handler)")
            out = out.detach().to("cpu", torch.float32).contiguous()
        except Exception as e:  # the shard's error travels back to the caller as text
            send_all(conn, error_reply(f"{type(e).__name__}: {e}", self.limits.max_error_bytes))
            return
        send_all(conn, [ok_reply(h.n, h.D), _bytes(out)])
        self.frames += 1

    def _reject(self, conn: socket.socket, message: str) -> None:
        self.rejected += 1
        try:
            send_all(conn, error_reply(message, self.limits.max_error_bytes))
        except OSError:
            pass


class ExpertClient:
    """One persistent connection to an :class:`ExpertServer`.

    Not thread-safe by itself: callers hold :attr:`lock` from :meth:`send` to the matching
    :meth:`recv`. Any TransportError leaves the connection unusable (:meth:`close` it).
    """

    def __init__(self, endpoint: ExpertEndpoint, *, timeout_s: float = 30.0, max_error_bytes: int = 64 << 10,
                 tls: ssl.SSLContext | None = None) -> None:
        self.endpoint, self.max_error_bytes = endpoint, max_error_bytes
        self.lock = threading.Lock()
        if endpoint.tls != (tls is not None):  # never fall back to plain TCP, and never send to a TLS port in clear
            raise TransportError(f"{endpoint.host}:{endpoint.port} takes {'only TLS' if endpoint.tls else 'plain TCP'} "
                                 f"connections but this client has {'no' if tls is None else 'a'} TLS context "
                                 "(expert_transport_tls must be set on every replica or on none)")
        try:
            self.sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
        except OSError as e:
            raise TransportError(f"cannot connect to {endpoint.host}:{endpoint.port}: {e}") from e
        try:
            if tls is not None:
                self.sock = tls.wrap_socket(self.sock)  # client side: verifies the server's certificate against the CA
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = REQUEST.pack(MAGIC, VERSION, MSG_HELLO, 0, TOKEN_BYTES, 0, 0, 0, 0, 0)
            send_all(self.sock, [hello, bytes.fromhex(endpoint.token)])
            self._read_reply(0, 0)
        except (OSError, TransportError, RemoteExpertError) as e:
            self.close()
            raise TransportError(f"handshake with {endpoint.host}:{endpoint.port} failed: {e}") from e

    def send(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
        try:
            send_all(self.sock, encode_run(layer, x, idx, w))
        except OSError as e:
            raise TransportError(f"send to {self.endpoint.host}:{self.endpoint.port} failed: {e}") from e

    def recv(self, n: int, D: int) -> torch.Tensor:
        """The reply to the last :meth:`send` of x [n, D]: out fp32 [n, D], or RemoteExpertError."""
        try:
            return self._read_reply(n, D)
        except OSError as e:
            raise TransportError(f"receive from {self.endpoint.host}:{self.endpoint.port} failed: {e}") from e

    def run(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.send(layer, x, idx, w)
            return self.recv(*x.shape)

    def close(self) -> None:
        self.sock.close()

    def _read_reply(self, n: int, D: int) -> torch.Tensor:
        status, rn, rD, nbytes = parse_reply(recv_bytes(self.sock, REPLY.size))
        if status == STATUS_ERROR:
            if nbytes > self.max_error_bytes:
                raise TransportError(f"bad reply header: error message of {nbytes} bytes")
            raise RemoteExpertError(recv_bytes(self.sock, nbytes).decode("utf-8", "replace"))
        if (rn, rD, nbytes) != (n, D, 4 * n * D):
            raise TransportError(f"bad reply header: n={rn}, D={rD}, nbytes={nbytes} for a request of [n, D] = [{n}, {D}]")
        out = torch.empty(n, D, dtype=torch.float32)
        if nbytes:
            recv_into(self.sock, _bytes(out))
        return out


def tls_context(config: "PlatformConfig", *, server_side: bool) -> ssl.SSLContext | None:
    """The data plane's TLS context of one side from ``config.expert_transport_tls`` (None: plain TCP)."""
    t = config.expert_transport_tls
    return None if t is None else ssl_context(t.cert_file, t.key_file, t.ca_file, server_side=server_side)
