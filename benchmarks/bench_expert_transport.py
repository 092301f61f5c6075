"""What mutual TLS costs the expert pool's direct data plane, side by side with plain TCP in one run.

Two shard servers (``ExpertShard`` of tiny-k3, shard 0 of 2) in this process, one plain and one with
``expert_transport_tls`` (a throwaway CA and one certificate, EC P-256, made here), each with a persistent
``ExpertClient``; round trips of one MoE layer's frame (1, 32 and 256 tokens, top-2 routed to the shard's
experts) alternate between the two, medians of ``--reps``. Also a null handler (returns zeros) on both, which
isolates the transport from the experts' compute. Every TLS reply is checked equal to the plain one.

Writes ``benchmarks/results/expert_transport.{json,md}``.

    .venv/bin/python benchmarks/bench_expert_transport.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import write_report  # noqa: E402
from deployments.config import ExpertTransportTLS, PlatformConfig  # noqa: E402
from deployments.experts.shard import ExpertShard  # noqa: E402
from deployments.experts.transport import tls_context  # noqa: E402
from deployments.experts.transport import ExpertClient, ExpertServer, FrameLimits  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_expert_transport.py"
MODEL = "tiny-k3"


def make_pki(d: Path) -> ExpertTransportTLS:
    """A CA and one certificate it signed (EC P-256, one day), as PEM files under ``d``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    certs = {}
    for cn, k, ca in (("bench CA", ca_key, True), ("bench replica", key, False)):
        certs[cn] = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name("bench CA"))
                     .public_key(k.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                     .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (d / "ca.pem").write_bytes(certs["bench CA"].public_bytes(pem))
    (d / "cert.pem").write_bytes(certs["bench replica"].public_bytes(pem))
    (d / "key.pem").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return ExpertTransportTLS(cert_file=str(d / "cert.pem"), key_file=str(d / "key.pem"), ca_file=str(d / "ca.pem"))


def frame(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 16, (n, 2), generator=g)
    return torch.randn(n, 128, generator=g), idx - idx % 2, torch.rand(n, 2, generator=g)  # shard 0 owns even ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_xp_tls_") as tmp:
        tls = make_pki(Path(tmp))
        plain_cfg = PlatformConfig(model=MODEL, expert_mode="pool", expert_shards=2)
        tls_cfg = plain_cfg.model_copy(update={"expert_transport_tls": tls})
        shards = {"plain": ExpertShard(plain_cfg, 0, 2), "tls": ExpertShard(tls_cfg, 0, 2)}
        nulls = {"plain": None, "tls": tls_context(tls_cfg, server_side=True)}
        null_servers = {k: ExpertServer(lambda layer, x, idx, w: torch.zeros_like(x), FrameLimits(dim=128, layers=frozenset({1})),
                                        tls=ctx) for k, ctx in nulls.items()}
        client_ctx = {"plain": None, "tls": tls_context(tls_cfg, server_side=False)}
        try:
            for handler, servers in (("experts", {k: s.server for k, s in shards.items()}), ("null", null_servers)):
                clients = {k: ExpertClient(s.endpoint, tls=client_ctx[k]) for k, s in servers.items()}
                for n in (1, 32, 256):
                    x, idx, w = frame(n)
                    want = clients["plain"].run(1, x, idx, w)
                    assert torch.equal(clients["tls"].run(1, x, idx, w), want), "TLS reply differs from the plain one"
                    ts = {k: [] for k in clients}
                    for _ in range(args.reps):
                        for k, c in clients.items():
                            t0 = time.perf_counter()
                            c.run(1, x, idx, w)
                            ts[k].append(time.perf_counter() - t0)
                    p, t = (1e6 * statistics.median(ts[k]) for k in ("plain", "tls"))
                    body = n * (128 * 4 + 2 * 8 + 2 * 4) + n * 128 * 4
                    rows.append({"handler": handler, "tokens": n, "bytes_per_round_trip": body, "plain_us": round(p, 1),
                                 "tls_us": round(t, 1), "tls_over_plain": round(t / p, 3), "tls_extra_us": round(t - p, 1)})
                    print(f"{handler:7s} n={n:3d}: plain {p:7.1f} us, TLS {t:7.1f} us ({t / p:.2f}x, +{t - p:.1f} us)",
                          flush=True)
                for c in clients.values():
                    c.close()
        finally:
            for s in (*shards.values(), *null_servers.values()):
                s.close()
    extra = {r["tokens"]: r["tls_extra_us"] for r in rows if r["handler"] == "experts"}
    paths = write_report(
        "expert_transport", rows,
        columns=["handler", "tokens", "bytes_per_round_trip", "plain_us", "tls_us", "tls_over_plain", "tls_extra_us"],
        command=COMMAND, out_dir=args.out_dir or Path(__file__).resolve().parent / "results",
        title="Expert pool data plane: mutual TLS vs plain TCP (one MoE layer's frame, round trip)",
        notes=f"One process, server threads and client on a {os.cpu_count()}-core shared CPU (1-min load average "
              f"{load_before:.1f} before the run); torch 1 thread; medians of {args.reps} interleaved round trips per "
              f"row over persistent connections (the handshake is paid once per connection). `experts`: tiny-k3's shard "
              f"0 of 2 computing its experts; `null`: a handler that returns zeros (the transport alone). A decode step "
              f"of 32 sequences makes 7 such calls per shard (one per MoE layer): TLS adds about "
              f"{7 * extra.get(32, 0) / 1e3:.2f} ms to it.")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    print(f"reproduce: {COMMAND}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
