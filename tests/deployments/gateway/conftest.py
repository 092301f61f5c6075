"""The HTTP API served in-process: real Prefill and Decode replicas of k3-tiny behind a
LocalBackend, the real Frontend, the real FastAPI app (``standalone_app``) under uvicorn on a
free 127.0.0.1 port in a thread, and the real openai client."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from cache_service import find_free_port
from deployments.config import PlatformConfig
from deployments.gateway.frontend import Frontend
from deployments.gateway.http_ingress import standalone_app
from deployments.tenancy import TenantRegistry
from deployments.workers.decode import Decode
from deployments.workers.local import LocalBackend
from deployments.workers.prefill import Prefill
from model import load_tokenizer

MODEL = "k3-tiny"
CONTEXT = 512  # tenant "alice"'s max_context
FAULTY = "/faulty"  # the same API over a backend that fails on purpose (FaultyBackend)
SECRET = "kaboom: secret internal detail"  # what FaultyBackend's errors say (no client may see it)


class FaultyBackend:
    """The real backend, failing on purpose: a prompt starting with "boom-prefill" fails in
    prefill, any other fails after decode's first chunk (an unexpected error, not a replica failure)."""

    def __init__(self, real: LocalBackend) -> None:
        self.real = real

    async def prefill(self, pool, req):
        if bytes(t for t in req.prompt_ids if t < 256).startswith(b"boom-prefill"):
            raise RuntimeError(SECRET)
        return await self.real.prefill(pool, req)

    async def decode(self, pool, req):
        async for chunk in self.real.decode(pool, req):
            yield chunk
            raise RuntimeError(SECRET)


@dataclass
class Served:
    url: str  # http://127.0.0.1:<port>
    key: str  # tenant "alice": both pools, max_context CONTEXT
    small_key: str  # tenant "bob": standard only, max_context 64, 2,000 tokens/min
    tight_key: str  # tenant "carol": standard only, 200 tokens/min
    frontend: Frontend
    faulty: Frontend  # the same over FaultyBackend (served under FAULTY)
    backend: LocalBackend
    loop: asyncio.AbstractEventLoop  # the server's loop (every engine call runs on it)

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.key, max_retries=0, timeout=60)

    def http(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key or self.key}"}, timeout=60)

    def run(self, coro):
        """Run ``coro`` on the server's loop (where the engines run) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def decode_stats(self, pool: str = "standard") -> dict:
        return self.backend.decode_replicas[pool].stats()


@pytest.fixture(scope="package")
def served(tmp_path_factory) -> Served:
    tmp = tmp_path_factory.mktemp("gateway")
    reg = TenantRegistry()
    _, alice = reg.add("alice", pools=["standard", "highspeed"], rpm=100_000, tpm=10_000_000, max_context=CONTEXT)
    _, bob = reg.add("bob", pools=["standard"], rpm=100_000, tpm=2_000, max_context=64)
    _, carol = reg.add("carol", pools=["standard"], rpm=100_000, tpm=200, max_context=512)
    reg.save(tmp / "tenants.yaml")
    config = PlatformConfig(model=MODEL, tenants_file=str(tmp / "tenants.yaml"), num_slots=8, trace_memory=True,
                            cache={"enabled": False})
    pools = ["standard", "highspeed"]
    backend = LocalBackend({p: Prefill(config, p) for p in pools}, {p: Decode(config, p) for p in pools})
    frontend = Frontend(model_name=MODEL, pools=pools, tokenizer=load_tokenizer(MODEL),
                        registry=TenantRegistry.from_file(config.tenants_file), backend=backend,
                        max_model_len=config.max_model_len, request_timeout_s={"standard": 60.0, "highspeed": 60.0})
    faulty = Frontend(model_name=MODEL, pools=pools, tokenizer=load_tokenizer(MODEL),
                      registry=TenantRegistry.from_file(config.tenants_file), backend=FaultyBackend(backend),
                      max_model_len=config.max_model_len)
    app = standalone_app(frontend)
    app.mount(FAULTY, standalone_app(faulty))
    port = find_free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    loops: list[asyncio.AbstractEventLoop] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        loops.append(loop)
        loop.run_until_complete(server.serve())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield Served(f"http://127.0.0.1:{port}", alice, bob, carol, frontend, faulty, backend, loops[0])
    server.should_exit = True
    thread.join(timeout=10)
