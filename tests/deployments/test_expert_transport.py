"""The expert pool's direct data plane over real sockets in one process (no Ray): frame codec,
ExpertShard's server + ExpertClient against `run_experts` on the model's weights, rejections."""

from __future__ import annotations

import gc
import socket
import time

import pytest
import torch

from deployments.config import PlatformConfig
from deployments.experts.client import ExpertPoolClient, shard_parts
from deployments.experts.shard import ExpertShard
from deployments.experts.transport import (MAGIC, MSG_HELLO, MSG_RUN, REPLY, REQUEST, TOKEN_BYTES, VERSION, ExpertClient,
                                          ExpertEndpoint, ExpertServer, FrameError, FrameLimits, RemoteExpertError,
                                          RunHeader, TransportError, check_run, parse_reply, parse_request, recv_bytes)
from model import load_model
from model.layers.moe import run_experts
from tests.conftest import ShardHandle

MODEL = "tiny-k3"
LIMITS = FrameLimits(dim=128, layers=frozenset({1, 2}), max_k=8, max_frame_bytes=1 << 20)


@pytest.fixture(scope="module")
def shards():
    config = PlatformConfig(model=MODEL, expert_mode="pool", expert_shards=2)
    out = [ExpertShard(config, s, 2) for s in range(2)]
    yield out
    for s in out:
        s.close()


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


def _inputs(n: int, k: int, shard: int | None, seed: int, num_experts: int = 16, D: int = 128):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    idx = torch.randint(0, num_experts, (n, k), generator=g)
    if shard is not None:  # only experts the shard owns (e % 2 == shard)
        idx = idx - idx % 2 + shard
    w = torch.rand(n, k, generator=g)
    return x, idx, w


def _ref(x, idx, w, experts) -> torch.Tensor:
    """`run_experts` as a shard runs it (inference mode: the packed fast path)."""
    with torch.inference_mode():
        return run_experts(x, idx, w, experts)


def _experts(model, layer: int):
    return model.model.layers[layer].block_sparse_moe.experts


def _fields(layer=1, n=3, D=128, k=2, dtypes=(1, 2, 1)):
    return (layer, n, D, k, *dtypes)


def test_a_shard_keeps_only_its_own_experts():
    from model.layers.moe import Expert

    def live_experts() -> int:
        gc.collect()
        return sum(isinstance(o, Expert) for o in gc.get_objects())

    before = live_experts()
    shard = ExpertShard(PlatformConfig(model=MODEL, expert_mode="pool", expert_transport="handle"), 1, 2)
    n_moe, half = len(shard.local), shard.num_experts // 2
    assert n_moe == 7 and half == 8 and all(len(m) == half for m in shard.local.values())  # tiny-k3: 7 MoE layers x 16
    assert live_experts() - before == n_moe * half  # not the other shard's, nor a whole model


def test_run_header_round_trip():
    kind, fields = parse_request(RunHeader(layer=2, n=37, D=128, k=8).pack())
    assert kind == MSG_RUN and check_run(fields, LIMITS) == RunHeader(2, 37, 128, 8)
    assert RunHeader(2, 37, 128, 8).body_bytes == 37 * (128 * 4 + 8 * 8 + 8 * 4)


@pytest.mark.parametrize("fields,message", [
    (_fields(dtypes=(2, 2, 1)), "x dtype: expected code 1, got 2"),
    (_fields(dtypes=(1, 1, 1)), "idx dtype: expected code 2, got 1"),
    (_fields(dtypes=(1, 2, 0)), "w dtype: expected code 1, got 0"),
    (_fields(layer=0), "layer: 0 has no routed experts here (MoE layers: [1, 2])"),
    (_fields(layer=-5), "layer: -5 has no routed experts"),
    (_fields(D=129), "D: expected 128, got 129"),
    (_fields(k=0), "k: expected 1..8, got 0"),
    (_fields(k=9), "k: expected 1..8, got 9"),
    (_fields(n=0), "n: 0 tokens"),
    (_fields(n=2000), "n: 2000 tokens (1072000 body bytes) is outside 1 token..1048576 bytes"),
    (_fields(n=2**32 - 1), "n: 4294967295 tokens"),
])
def test_check_run_names_the_bad_field(fields, message):
    with pytest.raises(FrameError) as e:
        check_run(fields, LIMITS)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("raw,message", [
    (REQUEST.pack(b"XXXX", VERSION, MSG_RUN, 1, 1, 128, 2, 1, 2, 1), "magic: expected b'DSXP', got b'XXXX'"),
    (REQUEST.pack(MAGIC, 9, MSG_RUN, 1, 1, 128, 2, 1, 2, 1), "version: expected 1, got 9"),
    (REQUEST.pack(MAGIC, VERSION, 7, 1, 1, 128, 2, 1, 2, 1), "type: expected 1 (HELLO) or 2 (RUN), got 7"),
])
def test_parse_request_rejects_magic_version_type(raw, message):
    with pytest.raises(FrameError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_request(raw)


def test_parse_reply_rejects_a_bad_status():
    with pytest.raises(TransportError, match="status 5"):
        parse_reply(REPLY.pack(MAGIC, VERSION, 5, 0, 0, 0))


@pytest.mark.parametrize("n,k", [(1, 2), (4, 2), (5, 2), (37, 2), (63, 8), (70, 8)])  # every run_experts path
def test_direct_run_equals_run_experts_exactly(shards, model, n, k):
    for s, shard in enumerate(shards):
        client = ExpertClient(shard.endpoint())
        try:
            for layer in (1, 7):
                x, idx, w = _inputs(n, k, s, seed=100 * n + layer)
                got = client.run(layer, x, idx, w)
                assert got.dtype == torch.float32 and got.shape == (n, 128)
                assert torch.equal(got, _ref(x, idx, w, _experts(model, layer)))
        finally:
            client.close()


def test_pool_split_over_two_shards_matches_colocated(shards, model):
    """The caller's split (other shards' experts at weight 0) summed over both shards, against the
    colocated experts of the same weights."""
    x, idx, w = _inputs(45, 2, None, seed=7)
    clients = [ExpertClient(s.endpoint()) for s in shards]
    out = torch.zeros(45, 128)
    for s, rows, sub_idx, sub_w in shard_parts(idx, w, 2):
        out.index_add_(0, rows, clients[s].run(3, x[rows].contiguous(), sub_idx, sub_w))
    for c in clients:
        c.close()
    ref = _ref(x, idx, w, _experts(model, 3))
    assert torch.equal(out, ref)


def test_stats_count_direct_calls(shards):
    before = shards[0].stats()
    client = ExpertClient(shards[0].endpoint())
    client.run(2, *_inputs(5, 2, 0, seed=1))
    client.close()
    after = shards[0].stats()
    assert after["direct_calls"] - before["direct_calls"] == 1 and after["handle_calls"] == before["handle_calls"]
    assert after["tokens"] - before["tokens"] == 5 and after["transport"] == "direct"


def test_bad_token_is_rejected(shards):
    ep = shards[0].endpoint()
    rejected = shards[0].server.rejected
    with pytest.raises(TransportError, match="bad token"):
        ExpertClient(ExpertEndpoint(ep.host, ep.port, "00" * 32))
    assert shards[0].server.rejected == rejected + 1
    ExpertClient(ep).close()  # the right token still works


def _send_raw(endpoint: ExpertEndpoint, header: bytes) -> tuple[str, bytes]:
    """Handshake, then ``header``; the error reply's text and what follows it (b'' once closed)."""
    client = ExpertClient(endpoint)
    sock = client.sock
    try:
        sock.sendall(header)
        status, _, _, nbytes = parse_reply(recv_bytes(sock, REPLY.size))
        assert status == 1
        text = recv_bytes(sock, nbytes).decode()
        sock.settimeout(5)
        return text, sock.recv(1)
    finally:
        client.close()


@pytest.mark.parametrize("header,message", [
    (REQUEST.pack(MAGIC, VERSION, MSG_RUN, 1, 4, 129, 2, 1, 2, 1), "bad frame: D: expected 128, got 129"),
    (REQUEST.pack(MAGIC, VERSION, MSG_RUN, 1, 10**9, 128, 2, 1, 2, 1), "bad frame: n: 1000000000 tokens"),
    (REQUEST.pack(MAGIC, VERSION, MSG_RUN, 0, 4, 128, 2, 1, 2, 1), "bad frame: layer: 0 has no routed experts here"),
    (REQUEST.pack(b"HTTP", VERSION, MSG_RUN, 1, 4, 128, 2, 1, 2, 1), "bad frame: magic"),
    (REQUEST.pack(MAGIC, VERSION, MSG_HELLO, 0, 32, 0, 0, 0, 0, 0), "bad frame: type: expected 2 (RUN) after the handshake, got 1"),
])
def test_malformed_header_is_rejected_and_the_connection_closed(shards, header, message):
    text, after = _send_raw(shards[1].endpoint(), header)
    assert text.startswith(message) and after == b""


def test_a_handshake_that_is_not_hello_is_rejected(shards):
    ep = shards[0].endpoint()
    with socket.create_connection((ep.host, ep.port), timeout=5) as sock:
        sock.sendall(RunHeader(1, 1, 128, 2).pack())
        status, _, _, nbytes = parse_reply(recv_bytes(sock, REPLY.size))
        assert status == 1 and recv_bytes(sock, nbytes).decode() == "bad handshake: type: expected 1 (HELLO) first, got 2"
        assert sock.recv(1) == b""


def test_shard_errors_come_back_as_clear_client_errors(shards, model):
    client = ExpertClient(shards[0].endpoint())
    try:
        x, idx, w = _inputs(4, 2, 1, seed=3)  # shard 1's experts sent to shard 0
        with pytest.raises(RemoteExpertError, match="^ValueError: shard 0 got tokens routed to experts it does not own$"):
            client.run(1, x, idx, w)
        with pytest.raises(RemoteExpertError, match=r"^ValueError: expert ids must be in 0..15, got 0..98$"):
            client.run(1, x, torch.tensor([[0, 98]] * 4), w)
        x, idx, w = _inputs(4, 2, 0, seed=3)  # the connection is still in sync
        assert torch.equal(client.run(1, x, idx, w), _ref(x, idx, w, _experts(model, 1)))
    finally:
        client.close()


def test_closed_shard_refuses_connections():
    shard = ExpertShard(PlatformConfig(model=MODEL, expert_mode="pool"), 0, 2)
    ep = shard.endpoint()
    client = ExpertClient(ep)
    shard.close()
    with pytest.raises(TransportError):
        client.run(1, *_inputs(2, 2, 0, seed=0))
    with pytest.raises(TransportError, match="cannot connect"):
        ExpertClient(ep)


def test_handle_transport_starts_no_server():
    shard = ExpertShard(PlatformConfig(model=MODEL, expert_mode="pool", expert_transport="handle"), 1, 2)
    assert shard.server is None and shard.stats()["transport"] == "handle"
    with pytest.raises(RuntimeError, match="expert_transport 'handle'"):
        shard.endpoint()


def test_pool_client_spreads_a_shards_calls_over_its_replicas_and_survives_one_going(shards, model):
    config = PlatformConfig(model=MODEL, expert_mode="pool", expert_shards=2)
    second = ExpertShard(config, 0, 2)  # another replica of shard 0
    replicas = [shards[0], second]
    pool = ExpertPoolClient([ShardHandle(replicas), ShardHandle([shards[1]])], discovery_s=60)
    try:
        before = [r.stats()["direct_calls"] for r in replicas]
        x, idx, w = _inputs(12, 2, None, seed=21)
        want = _ref(x, idx, w, _experts(model, 4))
        for _ in range(6):
            assert torch.equal(pool.run(4, x, idx, w), want)
        served = [r.stats()["direct_calls"] - b for r, b in zip(replicas, before)]
        assert served == [3, 3] and pool.stats()["replicas"] == [2, 1]  # round robin over both replicas
        second.close()  # one replica goes away: its connection fails once, the other replica takes its calls
        for _ in range(4):
            assert torch.equal(pool.run(4, x, idx, w), want)
        stats = pool.stats()
        assert stats["replicas"] == [1, 1] and stats["reconnects"] == 1
        assert stats["handle_calls"] == stats["fallbacks"] == 0
    finally:
        pool.close()
        second.close()


def test_pool_client_finds_a_new_replica_in_the_background(shards):
    config = PlatformConfig(model=MODEL, expert_mode="pool", expert_shards=2)
    handle = ShardHandle([shards[0]])
    pool = ExpertPoolClient([handle, ShardHandle([shards[1]])], discovery_s=0.05)
    added = ExpertShard(config, 0, 2)
    try:
        pool.run(1, *_inputs(4, 2, None, seed=2))
        assert pool.stats()["replicas"] == [1, 1]
        handle.replicas.append(added)  # scaled up
        deadline = time.monotonic() + 10
        while pool.stats()["replicas"][0] < 2:
            assert time.monotonic() < deadline, "the new replica was not found"
            time.sleep(0.02)
        before = added.stats()["direct_calls"]
        for _ in range(2):
            pool.run(1, *_inputs(4, 2, None, seed=3))
        assert added.stats()["direct_calls"] - before == 1
    finally:
        pool.close()
        added.close()


def _doubling_server(**bounds) -> ExpertServer:
    return ExpertServer(lambda layer, x, idx, w: x * 2, LIMITS, **bounds)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``seconds``, having sent nothing."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _served(client: ExpertClient) -> bool:
    x, idx, w = torch.randn(3, 128), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    return torch.equal(client.run(1, x, idx, w), x * 2)


def test_idle_connections_over_the_bound_are_closed_before_any_token_is_read():
    server = _doubling_server(max_connections=16, max_unauthenticated=4, hello_timeout_s=3.0)
    ep = server.endpoint
    early = ExpertClient(ep)  # authenticated before the flood
    idle = [socket.create_connection((ep.host, ep.port), timeout=5) for _ in range(10)]
    try:
        t0 = time.monotonic()
        extras = idle[4:]
        assert all(_closed_within(s, 1.0) for s in extras)  # over max_unauthenticated: closed on accept
        assert time.monotonic() - t0 < 1.5 and server.refused == 6
        assert not any(_closed_within(s, 0.01) for s in idle[:4])  # the first 4 wait for their HELLO
        assert _served(early)  # an authenticated connection is not held up by the flood
        assert all(_closed_within(s, 5.0) for s in idle[:4])  # no HELLO within hello_timeout_s
        assert 2.5 < time.monotonic() - t0 < 6.0 and server.timed_out == 4
        late = ExpertClient(ep)  # the slots are free again
        assert _served(late) and _served(early)
        late.close()
    finally:
        for s in idle:
            s.close()
        early.close()
        server.close()


def test_a_client_that_has_its_ok_no_longer_counts_against_max_unauthenticated():
    server = _doubling_server(max_unauthenticated=32)
    clients = []
    try:
        for _ in range(50):  # the count drops before the OK goes out, so no client that has its OK is still counted
            clients.append(ExpertClient(server.endpoint))
            assert server._unauthenticated == 0
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_hello_trickled_byte_by_byte_is_cut_at_the_deadline():
    server = _doubling_server(hello_timeout_s=1.0)
    ep = server.endpoint
    hello = REQUEST.pack(MAGIC, VERSION, MSG_HELLO, 0, TOKEN_BYTES, 0, 0, 0, 0, 0) + bytes.fromhex(ep.token)
    try:
        with socket.create_connection((ep.host, ep.port), timeout=5) as sock:
            t0, sent = time.monotonic(), 0
            try:
                for byte in hello:  # one byte per 0.2 s: each read is quick, the whole HELLO is not
                    sock.sendall(bytes([byte]))
                    sent += 1
                    time.sleep(0.2)
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert _closed_within(sock, 5.0)
            assert time.monotonic() - t0 < 3.0 and sent < len(hello)
        assert server.timed_out == 1 and server.frames == 0
        client = ExpertClient(ep)
        assert _served(client)
        client.close()
    finally:
        server.close()


def test_max_connections_counts_authenticated_connections_too():
    server = _doubling_server(max_connections=3, max_unauthenticated=2)
    clients = [ExpertClient(server.endpoint) for _ in range(3)]
    try:
        with pytest.raises(TransportError, match="handshake with 127.0.0.1"):
            ExpertClient(server.endpoint)  # a fourth: closed on accept
        assert server.refused == 1 and all(_served(c) for c in clients)
        clients.pop().close()
        deadline = time.monotonic() + 5
        while True:  # the server's side of the closed connection ends in its thread
            try:
                clients.append(ExpertClient(server.endpoint))
                break
            except TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert _served(clients[-1])
    finally:
        for c in clients:
            c.close()
        server.close()
    with pytest.raises(ValueError, match="need 1 <= max_unauthenticated <= max_connections, got 8 and 4"):
        _doubling_server(max_connections=4, max_unauthenticated=8)
