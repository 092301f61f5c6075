"""Mutual TLS on the expert pool's data plane (``expert_transport_tls``), over real sockets in one
process: the shard's server and the client with certificates made here by a throwaway CA, the
exact results of the plain path, and every way a peer without the right certificate is refused."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import time
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from deployments.config import ExpertTransportTLS, PlatformConfig
from deployments.experts.client import ExpertPoolClient
from deployments.experts.shard import ExpertShard
from deployments.experts.transport import tls_context
from deployments.experts.transport import (MAGIC, MSG_HELLO, REQUEST, TOKEN_BYTES, VERSION, ExpertClient, ExpertServer,
                                          FrameLimits, TransportError, recv_bytes, ssl_context)
from model import load_model
from model.layers.moe import run_experts
from tests.conftest import ShardHandle

MODEL = "tiny-k3"


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write_pki(d: Path, name: str) -> ExpertTransportTLS:
    """A CA and one replica certificate it signed, as PEM files under ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key, key = _key(), _key()
    ca = _cert(f"{name} CA", ca_key, f"{name} CA", ca_key, ca=True)
    cert = _cert(f"{name} replica", key, f"{name} CA", ca_key, ca=False)
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return ExpertTransportTLS(cert_file=str(d / "cert.pem"), key_file=str(d / "key.pem"), ca_file=str(d / "ca.pem"))


def _ctx(cert_file: str, key_file: str, ca_file: str, server_side: bool = False) -> ssl.SSLContext:
    return ssl_context(cert_file, key_file, ca_file, server_side=server_side)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    return {"cluster": _write_pki(root / "cluster", "cluster"), "other": _write_pki(root / "other", "other")}


@pytest.fixture(scope="module")
def tls_shards(pki):
    config = PlatformConfig(model=MODEL, expert_mode="pool", expert_shards=2, expert_transport_tls=pki["cluster"])
    out = [ExpertShard(config, s, 2) for s in range(2)]
    yield config, out
    for s in out:
        s.close()


def _inputs(n: int, k: int, shard: int, seed: int, D: int = 128):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 16, (n, k), generator=g)
    return torch.randn(n, D, generator=g), idx - idx % 2 + shard, torch.rand(n, k, generator=g)


def test_tls_run_equals_run_experts_exactly(tls_shards):
    config, shards = tls_shards
    model = load_model(MODEL)
    endpoint = shards[1].endpoint()
    assert endpoint.tls and endpoint.host == "127.0.0.1"
    client = ExpertClient(endpoint, tls=tls_context(config, server_side=False))
    assert isinstance(client.sock, ssl.SSLSocket) and client.sock.version() in ("TLSv1.2", "TLSv1.3")
    try:
        for n, k in ((1, 2), (33, 2), (7, 4)):
            x, idx, w = _inputs(n, k, shard=1, seed=n)
            with torch.inference_mode():
                want = run_experts(x, idx, w, model.model.layers[1].block_sparse_moe.experts)
            assert torch.equal(client.run(1, x, idx, w), want)
    finally:
        client.close()


def test_pool_client_over_tls_uses_the_direct_path(tls_shards):
    """ExpertPoolClient over in-process shards behind stand-in handles (``ShardHandle``): every call goes
    over TLS, none falls back."""
    config, shards = tls_shards
    pool = ExpertPoolClient([ShardHandle([s]) for s in shards], tls=tls_context(config, server_side=False))
    x, idx, w = _inputs(16, 2, shard=0, seed=3)
    idx = torch.randint(0, 16, idx.shape, generator=torch.Generator().manual_seed(5))
    experts = load_model(MODEL).model.layers[2].block_sparse_moe.experts
    with torch.inference_mode():
        want = run_experts(x, idx, w, experts)
    assert torch.allclose(pool.run(2, x, idx, w), want, atol=1e-6)
    stats = pool.stats()
    assert stats["direct_calls"] == 2 and stats["handle_calls"] == 0 and stats["fallbacks"] == 0
    pool.close()


def test_a_plain_client_is_refused_by_a_tls_shard(tls_shards):
    _, shards = tls_shards
    endpoint = shards[0].endpoint()
    with pytest.raises(TransportError, match="takes only TLS connections but this client has no TLS context"):
        ExpertClient(endpoint)
    # a client that ignores the endpoint and speaks the plain protocol anyway gets no answer, and no expert runs
    before = shards[0].server.rejected
    with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as s:
        s.sendall(REQUEST.pack(MAGIC, VERSION, MSG_HELLO, 0, TOKEN_BYTES, 0, 0, 0, 0, 0) + bytes.fromhex(endpoint.token))
        with pytest.raises((TransportError, OSError)):
            recv_bytes(s, 1)
    assert shards[0].server.rejected == before + 1


def test_a_certificate_from_another_ca_is_refused_both_ways(tls_shards, pki):
    _, shards = tls_shards
    endpoint = shards[0].endpoint()
    before, frames = shards[0].server.rejected, shards[0].server.frames
    with pytest.raises(TransportError, match="handshake with 127.0.0.1"):  # the client does not trust the shard's CA
        ExpertClient(endpoint, tls=_ctx(**pki["other"].model_dump()))
    # a client that trusts the cluster's CA but presents another CA's certificate: the shard refuses it
    mixed = _ctx(pki["other"].cert_file, pki["other"].key_file, pki["cluster"].ca_file)
    with pytest.raises(TransportError):
        ExpertClient(endpoint, tls=mixed).run(1, *_inputs(1, 2, shard=0, seed=1))
    deadline = time.monotonic() + 10  # the server's side of a failed handshake ends in its connection thread
    while shards[0].server.rejected < before + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert shards[0].server.rejected == before + 2 and shards[0].server.frames == frames


def test_a_tls_client_never_speaks_plain_tcp(pki):
    config = PlatformConfig(model=MODEL, expert_mode="pool", expert_shards=2)
    shard = ExpertShard(config, 0, 2)
    try:
        assert not shard.endpoint().tls
        with pytest.raises(TransportError, match="takes plain TCP connections but this client has a TLS context"):
            ExpertClient(shard.endpoint(), tls=_ctx(**pki["cluster"].model_dump()))
    finally:
        shard.close()


def test_bad_tls_files_are_named(pki, tmp_path):
    f = pki["cluster"]
    with pytest.raises(ValueError, match="key_file '/nonexistent/key.pem' is not a file"):
        _ctx(f.cert_file, "/nonexistent/key.pem", f.ca_file, server_side=True)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="ca_file .*junk.pem' does not load"):
        _ctx(f.cert_file, f.key_file, str(junk))
    with pytest.raises(ValueError, match="cert_file .*junk.pem' / key_file .* do not load"):
        _ctx(str(junk), f.key_file, f.ca_file, server_side=True)


def test_a_tls_handshake_that_never_starts_is_cut_at_the_deadline(pki):
    server = ExpertServer(lambda layer, x, idx, w: x * 2, FrameLimits(dim=4, layers=frozenset({1})),
                          tls=_ctx(**pki["cluster"].model_dump(), server_side=True), hello_timeout_s=0.5,
                          max_unauthenticated=1)
    ep = server.endpoint
    try:
        with socket.create_connection((ep.host, ep.port), timeout=5) as idle:
            t0 = time.monotonic()
            with socket.create_connection((ep.host, ep.port), timeout=5) as extra:
                assert extra.recv(1) == b""  # over max_unauthenticated: closed on accept, before any TLS
            assert idle.recv(1) == b""  # sent nothing: closed when the handshake's time is up
            assert 0.4 < time.monotonic() - t0 < 3.0
        assert (server.refused, server.timed_out, server.rejected) == (1, 1, 0)
        client = ExpertClient(ep, tls=_ctx(**pki["cluster"].model_dump()))
        x = torch.randn(2, 4)
        assert torch.equal(client.run(1, x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)), x * 2)
        client.close()
    finally:
        server.close()
