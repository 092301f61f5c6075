"""The serving engine: continuous batching, chunked prefill, swap preemption, prefill/decode
handoff, and its asyncio front. No Ray here: the Serve deployments wrap these classes.

    from deployments.engine import AsyncEngine, Engine, EngineConfig, GenerationRequest

Names load their submodule on first use (PEP 562): the ingress takes :class:`TokenLogprob` and the
errors without importing torch.
"""

import importlib

_EXPORTS = {
    "AsyncEngine": "async_engine", "nice_for_share": "async_engine",
    "Engine": "engine", "EngineConfig": "engine", "EngineStats": "engine", "StepCosts": "engine", "StepStats": "engine",
    "EngineBroken": "errors", "EngineStepError": "errors",
    "TokenLogprob": "logprobs",
    "ScheduledChunk": "scheduler", "Scheduler": "scheduler", "SchedulerOutput": "scheduler",
    "Checkpoint": "sequence", "CheckpointPlan": "sequence", "FinishReason": "sequence", "GenerationRequest": "sequence",
    "RequestOutput": "sequence", "Sequence": "sequence", "SequenceStatus": "sequence",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
