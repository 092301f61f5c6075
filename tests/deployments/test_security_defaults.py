"""Security defaults of `deltaserve up`: gRPC listens on 127.0.0.1 only, the generated API key never
reaches Ray's logs, and a DELTASERVE_API_KEY that no tenant of an existing tenants file has is
refused at start."""

import ipaddress
import re
from pathlib import Path

import httpx
import pytest

from deployments.tenancy import TenantRegistry
from tests.deployments.up_process import run_up


def listening_sockets() -> list[tuple[str, int, str]]:
    """(local address, port, socket inode) of every listening TCP socket, IPv4 and IPv6 (an IPv4-mapped IPv6
    address as its IPv4 address), from /proc/net/tcp{,6}: hex, 32-bit words in host (little-endian) order."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            hex_address, hex_port = fields[1].split(":")
            if fields[3] != "0A":  # 0A: LISTEN
                continue
            raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, len(hex_address), 8))
            address = ipaddress.ip_address(raw)
            mapped = getattr(address, "ipv4_mapped", None)
            out.append((str(mapped or address), int(hex_port, 16), fields[9]))
    return out


def _listeners(port: int) -> list[str]:
    """Local addresses of every listening TCP socket on ``port`` (:func:`listening_sockets`)."""
    return [address for address, p, _ in listening_sockets() if p == port]


def test_build_app_never_prints_a_key_and_refuses_without_one(tmp_path, monkeypatch, capsys):
    """build_app runs in Serve's controller, whose output lands in Ray's log files."""
    from deployments.app import build_app
    from deployments.config import PlatformConfig

    missing = tmp_path / "tenants.yaml"
    monkeypatch.delenv("DELTASERVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match=re.escape(f"tenants file {missing} does not exist")):
        build_app(PlatformConfig(tenants_file=str(missing)))
    assert not missing.exists()
    key = "ds-build-app-key-0123456789abcdef"
    monkeypatch.setenv("DELTASERVE_API_KEY", key)
    build_app(PlatformConfig(tenants_file=str(missing)))
    assert TenantRegistry.load(missing).authenticate(key).name == "dev"
    captured = capsys.readouterr()
    assert key not in captured.out + captured.err


def test_an_env_key_no_tenant_has_is_refused_at_start(tmp_path):
    path = tmp_path / "tenants.yaml"
    reg = TenantRegistry()
    reg.add("alice", pools=["standard"])
    reg.save(path)
    key = "ds-not-in-the-file-0123456789abcdef"
    done = run_up(["--tenants", str(path), "--no-cache"], env={"DELTASERVE_API_KEY": key})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"DELTASERVE_API_KEY is not a key of any enabled tenant in {path}" in done.stderr
    assert f"deltaserve tenants add NAME --file {path}" in done.stderr
    assert key not in done.stdout + done.stderr and "ready" not in done.stdout


def test_grpc_listens_on_localhost_only_and_the_generated_key_is_not_in_rays_logs(shared_platform):
    """On the shared platform, which `deltaserve up` started without a tenants file or $DELTASERVE_API_KEY (it
    showed a generated key once), after the tests that share it so far have run."""
    p = shared_platform
    key = p.dev_key
    assert key.startswith("ds-"), p.output
    r = httpx.get(f"{p.http_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    assert _listeners(p.up.grpc_port) == ["127.0.0.1"]  # and no socket on [::] or 0.0.0.0
    assert _listeners(p.up.http_port) == ["127.0.0.1"]
    session = p.up.ray_session_dir()
    files = [f for f in session.rglob("*") if f.is_file() and not f.is_symlink()]
    assert any(f.suffix in (".log", ".err", ".out") for f in files)
    leaked = [str(f) for f in files if key.encode() in f.read_bytes()]
    assert leaked == []


def test_check_env_key_accepts_a_key_of_the_file_and_names_the_file_otherwise(tmp_path):
    from deployments.cli.up import check_env_key

    path = tmp_path / "tenants.yaml"
    reg = TenantRegistry()
    _, key = reg.add("alice", pools=["standard"])
    reg.save(path)
    check_env_key(str(path), key)
    check_env_key(str(path), None)  # no DELTASERVE_API_KEY: nothing to check
    with pytest.raises(ValueError, match=re.escape(f"not a key of any enabled tenant in {path} (invalid API key;")):
        check_env_key(str(path), "ds-some-other-key-0123456789abcdef")
