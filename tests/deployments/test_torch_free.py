"""The processes that hold no model do not load torch: the ingress (HTTP and gRPC), cache-admin and
the `deltaserve up` process itself.

torch costs each process one to two CPU seconds to import and about 250 MiB of resident memory; a
platform start pays it once per process that imports it, on the same cores the engine replicas start
on. The ingress tokenizes, validates and relays; what it unpickles from the replicas (prefill results,
decode chunks, logprobs) is plain dataclasses.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.engine.logprobs import TokenLogprob
from deployments.workers.messages import DecodeChunk, DecodeRequest, PrefillRequest, PrefillResult
from model.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("deployments.gateway.ingress", "deployments.gateway.grpc_proxy", "deployments.workers.cache_admin",
           "deployments.workers.messages", "cache_service.admin", "cache_service.sealing")


def _messages() -> bytes:
    lp = TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.25)))
    preq = PrefillRequest("cmpl-1", (1, 2, 3), 8, SamplingParams(temperature=0.7, top_p=0.9, seed=3, logprobs=2))
    return pickle.dumps([
        preq,
        PrefillResult("cmpl-1", 7, "x", False, None, b"state", None, 3, 0, "r1", 0.01, first_logprob=lp),
        DecodeRequest(preq, 7, b"state"),
        DecodeChunk("yz", (8, 9), True, "length", 3, "r2", logprobs=(lp, lp)),
    ])


def test_the_ingress_and_cache_admin_import_and_unpickle_their_messages_without_torch():
    code = ("import pickle, sys\n"
            f"for m in {MODULES!r}: __import__(m)\n"
            "msgs = pickle.loads(sys.stdin.buffer.read())\n"
            "from model import load_tokenizer; load_tokenizer('k3-tiny').encode('hello')\n"
            "print(len(msgs), sorted(m for m in ('torch', 'model.network', 'deployments.engine.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, input=_messages(), capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == "4 []", out.stdout.decode()


def test_deltaserve_up_checks_its_config_tenants_and_cache_key_without_torch(tmp_path):
    """What `deltaserve up` does before it starts Ray (the config, the tenants file, the cache key) imports no torch."""
    code = ("import sys\n"
            "from deployments.cli.main import build_parser\n"
            "from deployments.cli.up import _load_config\n"
            f"args = build_parser().parse_args(['up', '--tenants', {str(tmp_path / 'tenants.yaml')!r}])\n"
            "config, key = _load_config(args)\n"
            "print(bool(key), config.cache.enabled, 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("DELTASERVE_API_KEY", "DELTASERVE_CACHE_KEY")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True True False", out.stdout
    assert (tmp_path / ".deltaserve-cache.key").stat().st_mode & 0o777 == 0o600


def test_the_model_s_lazy_names_still_resolve():
    """``from model import load_model`` (and the engine's names) load their torch modules on first use."""
    import deployments.engine as engine
    import model

    assert model.load_model("tiny-k3").config.vocab_size > 0
    assert model.KimiForCausalLM.__name__ == "KimiForCausalLM"
    assert {"AsyncEngine", "Engine", "TokenLogprob", "GenerationRequest"} <= set(dir(engine))
    assert engine.TokenLogprob is TokenLogprob
    assert {"load_model", "KimiForCausalLM", "load_tokenizer"} <= set(dir(model))
    with pytest.raises(AttributeError, match="no_such_name"):
        model.no_such_name  # noqa: B018


def _maps_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def test_on_the_platform_only_the_engine_replicas_load_torch(shared_platform):
    """After a streamed request with logprobs has gone through, the ingress and cache-admin replicas of
    `deltaserve up` have no libtorch mapped; every prefill and decode replica has."""
    import httpx

    r = httpx.post(f"{shared_platform.http_url}/v1/completions", headers=shared_platform.auth, timeout=120,
                   json={"model": "k3-tiny", "prompt": "def fib(n):", "max_tokens": 4, "logprobs": 2, "stream": True})
    assert r.status_code == 200 and "[DONE]" in r.text, r.text[:300]
    titles = {name: pids[0] for name, pids in shared_platform.replica_pids().items()}
    assert {"ingress", "cache-admin", "prefill-standard", "decode-standard"} <= set(titles), titles
    torchless = {name for name, pid in titles.items() if not _maps_torch(pid)}
    assert torchless == {"ingress", "cache-admin"}, titles
