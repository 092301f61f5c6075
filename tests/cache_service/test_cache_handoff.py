"""A turn prefilled on one replica and decoded on another is resumable by the next turn: the real Prefill and Decode
replicas of k3-tiny behind a LocalBackend, the real Frontend, a real redis-server.

A prompt under ``cache.prompt_checkpoint_min_tokens`` (256 here) gets no KDA checkpoint of its own, so the prefill
replica's blocks reach Redis only because it writes them when it hands the stream on (``Recorder.hand_on``); the
decode replica's turn-end checkpoint is resumable only with them.
"""

from __future__ import annotations

import asyncio

import pytest

from cache_service import LocalRedisServer
from deployments.config import PlatformConfig
from deployments.gateway.frontend import Frontend
from deployments.gateway.protocol import CompletionInput, Finished, TextDelta
from deployments.tenancy import TenantRegistry
from deployments.workers.decode import Decode
from deployments.workers.local import LocalBackend
from deployments.workers.prefill import Prefill
from model import load_tokenizer

MODEL = "k3-tiny"  # the trained model: it writes ASCII, so its output text re-encodes to its tokens
PROMPT = "import json\n\n\ndef load(path):\n    \"\"\"Read a JSON file and return its content, or None when missing.\"\"\"\n"


@pytest.fixture(scope="module")
def redis_server():
    server = LocalRedisServer().start()
    yield server
    server.stop()


def test_a_short_prompt_handed_from_prefill_to_decode_is_resumed_at_the_turn_s_end(tmp_path, redis_server):
    reg = TenantRegistry()
    _, key = reg.add("alice", pools=["standard"], rpm=100_000, tpm=10_000_000, max_context=1024)
    reg.save(tmp_path / "tenants.yaml")
    config = PlatformConfig(model=MODEL, tenants_file=str(tmp_path / "tenants.yaml"), num_slots=4,
                            cache={"redis_url": redis_server.url, "prompt_checkpoint_min_tokens": 256})
    prefill, decode = Prefill(config, "standard"), Decode(config, "standard")
    frontend = Frontend(model_name=MODEL, pools=["standard"], tokenizer=load_tokenizer(MODEL),
                        registry=TenantRegistry.from_file(config.tenants_file),
                        backend=LocalBackend({"standard": prefill}, {"standard": decode}),
                        max_model_len=config.max_model_len)  # no local prefill: every prompt goes through prefill

    async def complete(prompt: str, max_tokens: int) -> tuple[str, Finished]:
        text, done = "", None
        async for ev in frontend.complete(key, CompletionInput(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                               temperature=0, ignore_eos=True)):
            if isinstance(ev, TextDelta):
                text += ev.text
            else:
                done = ev
        assert done is not None
        return text, done

    async def turns():
        text, first = await complete(PROMPT, 48)
        assert prefill.stats()["prompt_tokens_computed"] == first.usage.prompt_tokens < 256  # prefilled there
        assert prefill.cache.flush_writes() and decode.cache.flush_writes()
        _, second = await complete(PROMPT + text + "\n\ndef save(path, data):\n", 4)
        return first.usage, second.usage

    try:
        first, second = asyncio.run(turns())
    finally:
        prefill.cache.close()
        decode.cache.close()
    block = config.cache.block_size
    computed = first.prompt_tokens + first.completion_tokens - 1  # the last sampled token is never fed
    assert first.cached_tokens == 0
    # the decode replica's checkpoint at the turn's last full block, on the prefill replica's blocks
    assert second.cached_tokens == computed // block * block > first.prompt_tokens
