"""Tenants: key hashing, file validation, authentication, pools, rate limits, usage, CLI."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import threading
import time

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.tenancy import (
    AuthError,
    BadRequestError,
    PermissionDeniedError,
    RateLimitedError,
    RateLimiter,
    Tenant,
    TenantError,
    TenantRegistry,
    TenantSpec,
    TenantsFile,
    TenantsFileError,
    UsageCounter,
    check_context,
    check_pool,
    default_dev_tenants,
    generate_api_key,
    hash_api_key,
)
from deployments.cli.tenants import add_tenants_parser

H1 = "sha256:" + "a" * 64
H2 = "sha256:" + "b" * 64


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def tenant(name="acme", rpm=60, tpm=100_000, pools=("standard",), max_context=8192) -> Tenant:
    return Tenant(name, tuple(pools), rpm, tpm, max_context, "s" * 32)


def spec(name, hashes=(), **kw) -> dict:
    return {"name": name, "key_hashes": list(hashes), **kw}


# ----------------------------------------------------------------------------- keys and file


def test_generated_key_and_hash_format():
    key = generate_api_key()
    assert key.startswith("ds-") and len(key) == 3 + 43 and not re.search(r"\s", key)
    assert generate_api_key() != key
    h = hash_api_key(key)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", h)
    assert hash_api_key("abc") == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_saved_file_never_contains_the_key(tmp_path):
    reg = TenantRegistry()
    spec_a, key_a = reg.add("acme", pools=["standard", "highspeed"], rpm=10, tpm=5000, max_context=4096)
    _, key_b = reg.add("bob")
    path = reg.save(tmp_path / "tenants.yaml")
    text = path.read_text()
    assert key_a not in text and key_b not in text
    assert key_a[3:] not in text and key_a[3:20] not in text
    assert hash_api_key(key_a) in text and hash_api_key(key_b) in text
    assert spec_a.key_hashes == [hash_api_key(key_a)]
    data = yaml.safe_load(text)
    assert data["version"] == 1
    assert [t["name"] for t in data["tenants"]] == ["acme", "bob"]
    assert data["tenants"][0]["allowed_pools"] == ["standard", "highspeed"]
    assert data["tenants"][0]["requests_per_minute"] == 10
    assert data["tenants"][0]["tokens_per_minute"] == 5000
    assert data["tenants"][0]["max_context"] == 4096
    assert data["tenants"][1]["allowed_pools"] == ["standard"]
    assert data["tenants"][1]["requests_per_minute"] == 60
    # the salts are generated per tenant and survive a round trip
    assert len(data["tenants"][0]["cache_salt"]) == 32 and data["tenants"][0]["cache_salt"] != data["tenants"][1]["cache_salt"]
    again = TenantRegistry.load(path)
    assert again.get("acme").cache_salt == reg.get("acme").cache_salt
    assert again.authenticate(key_a).name == "acme"


def test_save_is_atomic_with_mode_0600(tmp_path, monkeypatch):
    path = tmp_path / "tenants.yaml"
    path.write_text("old contents\n")
    os.chmod(path, 0o644)
    reg = TenantRegistry()
    reg.add("acme")
    reg.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["tenants.yaml"]  # no temp file left behind
    good = path.read_text()

    # a failure during the write leaves the old file whole and no temp file
    import deployments.tenancy.registry as mod

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mod.os, "replace", boom)
    reg.add("bob")
    with pytest.raises(OSError):
        reg.save(path)
    assert path.read_text() == good
    assert os.listdir(tmp_path) == ["tenants.yaml"]


def test_extra_fields_rejected():
    with pytest.raises(ValueError, match="rpm"):
        TenantSpec.model_validate(spec("acme", [H1], rpm=5))
    with pytest.raises(ValueError, match="owner"):
        TenantsFile.model_validate({"version": 1, "tenants": [], "owner": "x"})


@pytest.mark.parametrize("field,value,needle", [
    ("name", "Acme", "'Acme'"),
    ("name", "-acme", "'-acme'"),
    ("name", "a" * 64, "'" + "a" * 64 + "'"),
    ("allowed_pools", [], "must not be empty"),
    ("allowed_pools", ["turbo"], "'turbo'"),
    ("allowed_pools", ["standard", "standard"], "'standard' more than once"),
    ("requests_per_minute", 0, "requests_per_minute must be a positive integer, got 0"),
    ("tokens_per_minute", -5, "tokens_per_minute must be a positive integer, got -5"),
    ("max_context", "8k", "max_context must be a positive integer, got '8k'"),
    ("max_context", True, "got True"),
    ("cache_salt", "short", "at least 16 chars, got 5 chars"),
    ("disabled", "yes", "got 'yes'"),
])
def test_bad_values_are_named(field, value, needle):
    raw = spec("acme", [H1])
    raw[field] = value
    with pytest.raises(ValueError) as e:
        TenantSpec.model_validate(raw)
    assert needle in str(e.value)


def test_bad_hash_is_rejected_without_echoing_a_clear_key():
    key = generate_api_key()
    with pytest.raises(ValueError) as e:
        TenantSpec.model_validate(spec("acme", [key]))
    msg = str(e.value)
    assert "tenant 'acme'" in msg and "sha256:<64 lowercase hex>" in msg and key[:6] in msg
    assert key not in msg and key[20:] not in msg
    for bad in ["sha256:" + "A" * 64, "sha256:" + "a" * 63, "md5:" + "a" * 64, "a" * 64]:
        with pytest.raises(ValueError, match="is not of the form"):
            TenantSpec.model_validate(spec("acme", [bad]))
    TenantSpec.model_validate(spec("acme", [H1, H2]))


def test_defaults():
    s = TenantSpec(name="acme")
    assert s.allowed_pools == ["standard"] and s.requests_per_minute == 60 and s.tokens_per_minute == 100_000
    assert s.max_context == 8192 and not s.disabled and s.key_hashes == []
    assert re.fullmatch(r"[0-9a-f]{32}", s.cache_salt) and TenantSpec(name="acme").cache_salt != s.cache_salt
    for name, f in TenantSpec.model_fields.items():
        assert f.description, name
    for name, f in TenantsFile.model_fields.items():
        assert f.description, name


def test_duplicate_names_and_shared_hashes_rejected_naming_them():
    with pytest.raises(ValueError, match="duplicate tenant name 'acme'"):
        TenantsFile.model_validate({"version": 1, "tenants": [spec("acme", [H1]), spec("acme", [H2])]})
    with pytest.raises(ValueError) as e:
        TenantsFile.model_validate({"version": 1, "tenants": [spec("acme", [H1]), spec("bob", [H2, H1])]})
    assert "shared by tenants 'acme' and 'bob'" in str(e.value)
    with pytest.raises(ValueError, match="'acme' and 'bob' have the same cache_salt"):
        TenantsFile.model_validate({"version": 1, "tenants": [spec("acme", [H1], cache_salt="x" * 16),
                                                              spec("bob", [H2], cache_salt="x" * 16)]})
    with pytest.raises(ValueError, match="version 2"):
        TenantsFile.model_validate({"version": 2, "tenants": []})


def test_load_errors_name_file_and_value(tmp_path):
    path = tmp_path / "t.yaml"
    with pytest.raises(TenantsFileError, match="no tenants file"):
        TenantRegistry.load(path)
    path.write_text("")
    with pytest.raises(TenantsFileError, match="empty"):
        TenantRegistry.load(path)
    path.write_text("version: 1\ntenants:\n- name: acme\n  requests_per_minute: 0\n")
    with pytest.raises(TenantsFileError) as e:
        TenantRegistry.from_file(path)
    assert str(path) in str(e.value) and "tenants.0.requests_per_minute" in str(e.value) and "got 0" in str(e.value)
    path.write_text("version: 1\ntenants: [\n")
    with pytest.raises(TenantsFileError, match=r"not valid YAML: expected the node content, but found '<stream end>' "
                                                r"\(line 3, column 1\)$"):
        TenantRegistry.load(path)


# ----------------------------------------------------------------------------- authentication


@pytest.fixture()
def reg():
    r = TenantRegistry()
    _, k1 = r.add("acme", pools=["standard", "highspeed"])
    _, k2 = r.add("bob")
    r.keys = {"acme": k1, "bob": k2}
    return r


def test_authenticate_bare_and_bearer(reg):
    k = reg.keys["acme"]
    assert reg.authenticate(k).name == "acme"
    assert reg.authenticate(f"Bearer {k}").name == "acme"
    assert reg.authenticate(f"bearer  {k} ").name == "acme"
    assert reg.authenticate(reg.keys["bob"]).name == "bob"
    t = reg.authenticate(k)
    assert t.allowed_pools == ("standard", "highspeed") and t.requests_per_minute == 60
    assert t.cache_salt not in repr(t)


@pytest.mark.parametrize("value", [None, "", "   ", "Bearer", "Bearer   "])
def test_authenticate_missing(reg, value):
    with pytest.raises(AuthError) as e:
        reg.authenticate(value)
    assert e.value.message == "missing API key" and str(e.value) == "missing API key"
    assert (e.value.status, e.value.grpc_code, e.value.code) == (401, "UNAUTHENTICATED", "missing_api_key")
    assert e.value.headers() == {"WWW-Authenticate": "Bearer"}


@pytest.mark.parametrize("make", [lambda k: k + "x", lambda k: k[:-1], lambda k: "Bearer " + k.upper(),
                                  lambda k: "Basic " + k, lambda k: generate_api_key(), lambda k: hash_api_key(k)])
def test_authenticate_wrong(reg, make):
    bad = make(reg.keys["acme"])
    with pytest.raises(AuthError) as e:
        reg.authenticate(bad)
    assert e.value.message == "invalid API key"
    assert (e.value.status, e.value.grpc_code, e.value.code) == (401, "UNAUTHENTICATED", "invalid_api_key")
    assert e.value.error_body() == {"error": {"message": "invalid API key", "type": "authentication_error",
                                              "param": None, "code": "invalid_api_key"}}
    assert isinstance(e.value, TenantError)


def test_disabled_tenant_is_refused(tmp_path):
    key = generate_api_key()
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "tenants": [spec("acme", [hash_api_key(key)], disabled=True)]}))
    with pytest.raises(PermissionDeniedError) as e:
        TenantRegistry.load(path).authenticate(key)
    assert e.value.status == 403 and e.value.code == "tenant_disabled" and "'acme'" in e.value.message


def test_check_pool_403_message(reg):
    bob = reg.authenticate(reg.keys["bob"])
    check_pool(bob, "standard")
    with pytest.raises(PermissionDeniedError) as e:
        check_pool(bob, "highspeed")
    assert e.value.message == "tenant 'bob' is not allowed to use pool 'highspeed'; allowed pools: standard"
    assert (e.value.status, e.value.grpc_code, e.value.code, e.value.type) == (
        403, "PERMISSION_DENIED", "model_not_allowed", "permission_error")
    check_pool(reg.authenticate(reg.keys["acme"]), "highspeed")


def test_check_context():
    t = tenant(max_context=100)
    check_context(t, 60, 40)
    with pytest.raises(BadRequestError) as e:
        check_context(t, 60, 41)
    assert e.value.code == "context_length_exceeded" and e.value.status == 400
    assert "60 prompt tokens + 41 max output tokens = 101 exceeds tenant 'acme' max_context of 100" in e.value.message


def test_add_rejects_duplicate_and_bad_values(reg):
    with pytest.raises(ValueError, match="tenant 'bob' already exists"):
        reg.add("bob")
    with pytest.raises(ValueError, match="'turbo'"):
        reg.add("carol", pools=["turbo"])
    assert "carol" not in reg and len(reg) == 2


def test_revoke(reg):
    removed = reg.revoke("bob")
    assert removed.name == "bob" and "bob" not in reg
    with pytest.raises(AuthError, match="invalid API key"):
        reg.authenticate(reg.keys["bob"])
    assert reg.authenticate(reg.keys["acme"]).name == "acme"
    with pytest.raises(KeyError, match="'bob'"):
        reg.revoke("bob")


def test_reload_if_changed(tmp_path, caplog):
    path = tmp_path / "t.yaml"
    reg = TenantRegistry()
    _, k1 = reg.add("acme")
    reg.save(path)
    live = TenantRegistry.load(path)
    assert live.reload_if_changed() is False

    # another process (the CLI) adds a tenant
    editor = TenantRegistry.load(path)
    _, k2 = editor.add("bob", rpm=7)
    editor.save(path)
    with pytest.raises(AuthError):
        live.authenticate(k2)
    assert live.reload_if_changed() is True
    assert live.authenticate(k2).requests_per_minute == 7
    assert live.reload_if_changed() is False

    # a broken edit keeps the last good tenants, and is not re-read on every call
    text = path.read_text()
    path.write_text(text.replace("requests_per_minute: 7", "requests_per_minute: -1"))
    assert live.reload_if_changed() is False
    assert "got -1" in caplog.text
    assert live.authenticate(k2).name == "bob"
    caplog.clear()
    assert live.reload_if_changed() is False and caplog.text == ""

    # fixed again: loaded; a revoke is seen
    editor.revoke("bob")
    editor.save(path)
    assert live.reload_if_changed() is True
    with pytest.raises(AuthError):
        live.authenticate(k2)
    assert live.authenticate(k1).name == "acme"

    # a vanished file keeps the tenants
    path.unlink()
    assert live.reload_if_changed() is False and live.authenticate(k1).name == "acme"


def test_default_dev_tenants(tmp_path):
    path = tmp_path / "sub" / "tenants.yaml"
    reg, key = default_dev_tenants(path, None)
    assert key is not None and key.startswith("ds-") and key not in path.read_text()
    dev = reg.authenticate(key)
    assert dev.name == "dev" and dev.allowed_pools == ("standard", "highspeed")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # the file exists now: loaded, nothing generated
    reg2, key2 = default_dev_tenants(path, "ignored-key")
    assert key2 is None and reg2.authenticate(key).name == "dev"

    path2 = tmp_path / "t2.yaml"
    reg3, key3 = default_dev_tenants(path2, "my-dev-key")
    assert key3 is None and reg3.authenticate("Bearer my-dev-key").name == "dev"
    assert "my-dev-key" not in path2.read_text()
    with pytest.raises(ValueError, match="whitespace"):
        default_dev_tenants(tmp_path / "t3.yaml", "has space")
    assert not (tmp_path / "t3.yaml").exists()


# ----------------------------------------------------------------------------- rate limiting


def test_requests_per_minute_exact_retry_after():
    clock = Clock(1000.0)
    rl = RateLimiter(clock)
    t = tenant(rpm=3)
    for dt in (0.0, 10.0, 20.0):
        clock.t = 1000.0 + dt
        rl.acquire(t, 1)
    clock.t = 1030.0
    with pytest.raises(RateLimitedError) as e:
        rl.acquire(t, 1)
    err = e.value
    assert err.retry_after_s == pytest.approx(30.0)  # the admission at t=1000 leaves at t=1060
    assert err.retry_after_header == "30" and err.headers() == {"Retry-After": "30"}
    assert (err.status, err.grpc_code, err.code) == (429, "RESOURCE_EXHAUSTED", "rate_limit_exceeded")
    assert "requests per minute" in err.message and "3 of 3 requests" in err.message and "'acme'" in err.message
    clock.t = 1059.5
    with pytest.raises(RateLimitedError) as e:
        rl.acquire(t, 1)
    assert e.value.retry_after_s == pytest.approx(0.5) and e.value.retry_after_header == "1"
    clock.t = 1060.0
    rl.acquire(t, 1)
    assert rl.usage(t) == (3, 3)
    # tenants are independent
    rl.acquire(tenant("bob", rpm=1), 1)


def test_tokens_per_minute_exact_retry_after_and_refund():
    clock = Clock(0.0)
    rl = RateLimiter(clock)
    t = tenant(rpm=100, tpm=1000)
    rl.acquire(t, 400)  # t=0
    clock.t = 5.0
    r2 = rl.acquire(t, 300)  # t=5
    clock.t = 10.0
    rl.acquire(t, 200)  # t=10 -> 900 used
    clock.t = 20.0
    with pytest.raises(RateLimitedError) as e:
        rl.acquire(t, 500)  # needs 400 freed: the t=0 admission (400) -> at t=60
    assert e.value.retry_after_s == pytest.approx(40.0)
    assert "tokens per minute" in e.value.message and "900 of 1000 tokens" in e.value.message
    assert "reserves 500" in e.value.message
    with pytest.raises(RateLimitedError) as e:
        rl.acquire(t, 800)  # needs 700: t=0 (400) + t=5 (300) -> at t=65
    assert e.value.retry_after_s == pytest.approx(45.0) and e.value.retry_after_header == "45"
    rl.acquire(t, 100)  # exactly fits: 1000
    assert rl.usage(t) == (4, 1000)

    # the t=5 request generated fewer tokens than reserved: 250 come back now
    assert rl.refund(t, 250, reservation=r2) == 250
    assert rl.usage(t) == (4, 750)
    rl.acquire(t, 250)
    assert rl.usage(t) == (5, 1000)
    # refund without a reservation: oldest admission first, never below zero
    assert rl.refund(t, 10_000) == 1000 and rl.usage(t) == (5, 0)
    # refunding an admission that already left the window credits nothing
    clock.t = 100.0
    assert rl.refund(t, 50, reservation=r2) == 0
    assert rl.refund("nobody", 5) == 0


def test_refund_without_reservation_credits_oldest_first():
    clock = Clock(0.0)
    rl = RateLimiter(clock)
    t = tenant(rpm=100, tpm=1000)
    rl.acquire(t, 500)
    clock.t = 30.0
    rl.acquire(t, 500)
    rl.refund(t, 400)  # credited to the t=0 admission (which leaves at t=60)
    clock.t = 60.0
    assert rl.usage(t) == (1, 500)  # the t=30 admission still holds all its 500


def test_both_limits_report_the_longer_wait():
    clock = Clock(0.0)
    rl = RateLimiter(clock)
    t = tenant(rpm=2, tpm=100)
    rl.acquire(t, 90)
    clock.t = 10.0
    rl.acquire(t, 0)
    clock.t = 20.0
    with pytest.raises(RateLimitedError) as e:
        rl.acquire(t, 50)  # requests free at 60 (t=0 leaves); tokens also at 60
    assert e.value.retry_after_s == pytest.approx(40.0)
    clock.t = 65.0
    rl.acquire(t, 50)


def test_request_larger_than_tpm_is_400_not_429():
    rl = RateLimiter(Clock())
    t = tenant(tpm=1000)
    with pytest.raises(BadRequestError) as e:
        rl.acquire(t, 1001)
    assert (e.value.status, e.value.grpc_code, e.value.code) == (400, "INVALID_ARGUMENT", "request_too_large")
    assert "1001 tokens" in e.value.message and "1000 tokens per minute" in e.value.message
    rl.acquire(t, 1000)
    assert rl.usage(t) == (1, 1000)
    with pytest.raises(ValueError, match="-1"):
        rl.acquire(t, -1)


def test_rejected_request_consumes_nothing():
    clock = Clock(0.0)
    rl = RateLimiter(clock)
    t = tenant(rpm=5, tpm=100)
    rl.acquire(t, 90)
    with pytest.raises(RateLimitedError):
        rl.acquire(t, 20)
    assert rl.usage(t) == (1, 90)


def test_lowered_limit_applies_at_once():
    clock = Clock(0.0)
    rl = RateLimiter(clock)
    for i in range(5):
        clock.t = float(i)
        rl.acquire(tenant(rpm=5), 1)
    with pytest.raises(RateLimitedError) as e:
        rl.acquire(tenant(rpm=2), 1)  # 5 in window, limit 2: the 4th oldest (t=3) must leave
    assert e.value.retry_after_s == pytest.approx(59.0)


def test_limiter_thread_safe():
    rl = RateLimiter(Clock(0.0))
    t = tenant(rpm=500, tpm=10**9)
    ok = []

    def worker():
        for _ in range(100):
            try:
                rl.acquire(t, 1)
                ok.append(1)
            except RateLimitedError:
                pass

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(ok) == 500 and rl.usage(t) == (500, 500)


@settings(max_examples=300, deadline=None)
@given(rpm=st.integers(1, 12),
       steps=st.lists(st.tuples(st.floats(0, 40, allow_nan=False), st.integers(1, 4)), min_size=1, max_size=120))
def test_property_never_more_than_rpm_in_any_60s_window(rpm, steps):
    clock = Clock(0.0)
    rl = RateLimiter(clock)
    t = tenant(rpm=rpm, tpm=10**9)
    admitted: list[float] = []
    for dt, burst in steps:
        clock.t += dt
        for _ in range(burst):
            in_window = sum(1 for a in admitted if clock.t - a < 60.0)
            try:
                rl.acquire(t, 1)
                admitted.append(clock.t)
                assert in_window < rpm
            except RateLimitedError as e:
                # refused only when the window is full, and retry_after is when it stops being full
                assert in_window >= rpm
                oldest = admitted[-rpm]  # the admission that must leave the window
                assert e.retry_after_s == pytest.approx(oldest + 60.0 - clock.t, abs=1e-9)
                assert (clock.t + e.retry_after_s) - oldest >= 60.0  # retrying then succeeds
    for a in admitted:
        assert sum(1 for b in admitted if a <= b and b - a < 60.0) <= rpm


@settings(max_examples=200, deadline=None)
@given(tpm=st.integers(1, 500), steps=st.lists(st.tuples(st.floats(0, 30, allow_nan=False), st.integers(0, 200)),
                                                min_size=1, max_size=80))
def test_property_never_more_than_tpm_in_any_60s_window(tpm, steps):
    clock = Clock(0.0)
    rl = RateLimiter(clock)
    t = tenant(rpm=10**6, tpm=tpm)
    admitted: list[tuple[float, int]] = []
    for dt, n in steps:
        clock.t += dt
        try:
            rl.acquire(t, n)
            admitted.append((clock.t, n))
        except RateLimitedError as e:
            # retrying after retry_after_s succeeds (if nothing else is admitted meanwhile)
            probe = RateLimiter(clock)
            for a, m in admitted:
                saved = clock.t
                clock.t = a
                probe.acquire(t, m)
                clock.t = saved
            clock.t += e.retry_after_s
            probe.acquire(t, n)
            clock.t -= e.retry_after_s
        except BadRequestError:
            assert n > tpm
    for a, _ in admitted:
        assert sum(m for b, m in admitted if a <= b and b - a < 60.0) <= tpm


# ----------------------------------------------------------------------------- usage


def test_usage_counter():
    u = UsageCounter()
    u.record(tenant("acme"), prompt_tokens=10, completion_tokens=5, cached_tokens=4)
    u.record("acme", prompt_tokens=3, status=429)
    u.record("acme", status=429)
    u.record("bob", status=401)
    u.record("acme", prompt_tokens=2, completion_tokens=1, error=True)
    snap = u.snapshot()
    assert snap == {
        "acme": {"requests": 4, "prompt_tokens": 15, "completion_tokens": 6, "cached_tokens": 4,
                 "errors": {"429": 2, "unknown": 1}},
        "bob": {"requests": 1, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "errors": {"401": 1}},
    }
    snap["acme"]["errors"]["429"] = 99  # a copy
    assert u.snapshot()["acme"]["errors"]["429"] == 2
    assert json.loads(json.dumps(u.snapshot())) == u.snapshot()

    threads = [threading.Thread(target=lambda: [u.record("c", prompt_tokens=1) for _ in range(1000)]) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert u.snapshot()["c"]["requests"] == 4000 and u.snapshot()["c"]["prompt_tokens"] == 4000


# ----------------------------------------------------------------------------- CLI


def cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="deltaserve")
    add_tenants_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_add_list_revoke(tmp_path, capsys, monkeypatch):
    path = tmp_path / "t.yaml"
    monkeypatch.setenv("DELTASERVE_TENANTS", str(path))
    rc, out, err = cli(["tenants", "add", "acme", "--pools", "standard,highspeed", "--rpm", "120",
                        "--tpm", "5000", "--max-context", "2048"], capsys)
    assert rc == 0
    key = out.strip()
    assert re.fullmatch(r"ds-[A-Za-z0-9_-]{43}", key)
    assert "cannot be shown again" in err and key not in err
    assert key not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    reg = TenantRegistry.load(path)
    acme = reg.authenticate(key)
    assert (acme.allowed_pools, acme.requests_per_minute, acme.tokens_per_minute, acme.max_context) == (
        ("standard", "highspeed"), 120, 5000, 2048)

    rc, out2, _ = cli(["tenants", "add", "bob", "--file", str(path)], capsys)
    assert rc == 0 and out2.strip() != key

    rc, out, _ = cli(["tenants", "list"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "POOLS", "RPM", "TPM", "MAX_CONTEXT", "KEYS", "DISABLED"]
    assert lines[1].split() == ["acme", "standard,highspeed", "120", "5000", "2048", "1", "no"]
    assert lines[2].split() == ["bob", "standard", "60", "100000", "8192", "1", "no"]
    assert "sha256" not in out and key not in out

    rc, out, _ = cli(["tenants", "list", "--json"], capsys)
    rows = json.loads(out)
    assert rows[0] == {"name": "acme", "pools": ["standard", "highspeed"], "requests_per_minute": 120,
                       "tokens_per_minute": 5000, "max_context": 2048, "keys": 1, "disabled": False}
    assert "sha256" not in out and "cache_salt" not in out

    rc, out, err = cli(["tenants", "revoke", "bob"], capsys)
    assert rc == 0 and "'bob'" in err
    assert [s.name for s in TenantRegistry.load(path).specs] == ["acme"]


@pytest.mark.parametrize("argv,needle", [
    (["tenants", "add", "Acme"], "'Acme'"),
    (["tenants", "add", "acme", "--pools", "standard,turbo"], "'turbo'"),
    (["tenants", "add", "acme", "--rpm", "0"], "requests_per_minute must be a positive integer, got 0"),
    (["tenants", "add", "acme", "--pools", ","], "must not be empty"),
    (["tenants", "add", "old"], "tenant 'old' already exists"),
    (["tenants", "revoke", "nobody"], "no tenant named 'nobody'"),
])
def test_cli_errors_exit_2(tmp_path, capsys, argv, needle):
    path = tmp_path / "t.yaml"
    reg = TenantRegistry()
    reg.add("old")
    reg.save(path)
    before = path.read_text()
    rc, out, err = cli([*argv, "--file", str(path)], capsys)
    assert rc == 2 and needle in err and out == ""
    assert path.read_text() == before


def test_cli_missing_or_bad_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DELTASERVE_TENANTS", raising=False)
    rc, _, err = cli(["tenants", "list"], capsys)
    assert rc == 2 and "tenants.yaml" in err
    rc, _, err = cli(["tenants", "revoke", "x"], capsys)
    assert rc == 2 and "tenants.yaml" in err
    (tmp_path / "tenants.yaml").write_text("version: 1\ntenants:\n- name: a\n  colour: red\n")
    rc, _, err = cli(["tenants", "add", "b"], capsys)
    assert rc == 2 and "colour" in err
    # the default file in the working directory
    (tmp_path / "tenants.yaml").unlink()
    rc, out, _ = cli(["tenants", "add", "b"], capsys)
    assert rc == 0 and TenantRegistry.load(tmp_path / "tenants.yaml").authenticate(out.strip()).name == "b"


def test_the_wait_for_an_admission_to_expire_is_found_in_a_few_steps():
    """``now + wait`` must pass the window edge; where ``t0 + 60 - now`` rounds to 0 but the edge is
    not reached, stepping a zero wait by one ulp at a time would take up to 2**52 rounds."""
    from deployments.tenancy.limits import WINDOW_S, _wait_until_expired

    t0, now = 69.92533507727178, 129.92533507727174  # t0 + 60 - now == 0.0, yet now - t0 < 60
    started = time.perf_counter()
    wait = _wait_until_expired(t0, now)
    assert (now + wait) - t0 >= WINDOW_S and wait < 1e-9
    assert time.perf_counter() - started < 0.1
