"""The serving engine: continuous batching, chunked prefill, swap preemption, prefill/decode
handoff, and its asyncio front. No Ray here: the Serve deployments wrap these classes.

    from deployments.engine import AsyncEngine, Engine, EngineConfig, GenerationRequest
"""

from .async_engine import AsyncEngine, nice_for_share
from .engine import Engine, EngineConfig, EngineStats, StepCosts, StepStats
from .errors import EngineBroken, EngineStepError
from .scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from .sequence import (
    Checkpoint,
    CheckpointPlan,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    Sequence,
    SequenceStatus,
    TokenLogprob,
)

__all__ = [
    "AsyncEngine",
    "Checkpoint",
    "CheckpointPlan",
    "Engine",
    "EngineBroken",
    "EngineConfig",
    "EngineStats",
    "EngineStepError",
    "FinishReason",
    "GenerationRequest",
    "RequestOutput",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "StepCosts",
    "StepStats",
    "TokenLogprob",
    "nice_for_share",
]
