"""The direct prefill → decode state handoff through Ray's object store.

A prefill replica puts the state bytes (:meth:`SequenceState.to_bytes`, ~460 KB for
tiny-k3) into the object store and returns a reference; the ingress forwards the reference
in the :class:`~deployments.workers.messages.DecodeRequest` without fetching it, and the decode
replica fetches the bytes. They cross from the prefill process to the decode process once
(shared memory on one node), instead of being returned to the ingress and sent on again
(two object-store round trips and the ingress's CPU for each).

The prefill replica owns the object: it lives while a reference to it does (the ingress's,
then the decode replica's) and is freed when the last is dropped (a stream cancelled
before decode included). A prefill replica that dies before decode fetches it loses the
object: the fetch raises :class:`~deployments.gateway.protocol.HandoffLost` and the frontend prefills
again (the same path as a handoff lost from the cache service).

In-process (:class:`~deployments.workers.local.LocalBackend`) the bytes travel as they are, and so
they do where Serve sends replies between replicas over gRPC (throughput-optimized Serve,
:func:`serve_replies_by_grpc`): a reference pickled into a gRPC reply is serialized out of
band, and Ray then pins its object for the owner's lifetime (a leak per request), while
the bytes cost the ingress only a copy there.

Those gRPC messages are bounded: Serve's replica servers and channels receive at most
``RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH`` bytes (4 MiB by default), and the state grows with
the prompt (MLA latents: 640 bytes per token for k3-tiny, 4.2 MiB at about 6,000 tokens). Every
deployment therefore runs with the limit raised to :func:`grpc_message_limit` (``deployments/app.py``),
the largest prefill reply or decode request the config's context allows.
"""

from __future__ import annotations

from typing import Any

from deployments.gateway.errors import HandoffLost

GRPC_LIMIT_ENV = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"  # read by ray.serve._private.constants at import
SERVE_DEFAULT_GRPC_LIMIT = 4 << 20  # Serve's value of it when unset (gRPC's own default)
_TOKEN_ID_BYTES = 16  # upper bound on one token id in a pickled message (prompt_ids, replay_ids, token_ids)


def state_bytes(model: str, tokens: int) -> int:
    """Bytes of :meth:`SequenceState.to_bytes` after ``tokens`` tokens of ``model`` (a name, preset or
    checkpoint directory), without loading weights: KDA state and conv tails (fixed size) plus the MLA
    latents of every token (fp32, as the replicas load the model), the header and the checksum."""
    from model import resolve_model
    from model.config import ModelConfig
    from model.presets import preset_config

    kind, path = resolve_model(model)
    config = ModelConfig.from_hf(preset_config(model)) if kind == "preset" else ModelConfig.from_file(path)
    kda, n_kda = config.kda, len(config.kda_layers)
    fixed = n_kda * 4 * (kda.num_heads * kda.head_dim * kda.head_dim + 3 * kda.proj_dim * (kda.conv_kernel - 1))
    header = 512 + 64 * (2 * n_kda + len(config.mla_layers))  # magic, version, JSON fingerprint and shapes, CRC
    return fixed + len(config.mla_layers) * config.mla_latent_dim * 4 * tokens + header


def grpc_message_limit(model: str, max_model_len: int) -> int:
    """The gRPC message size every deployment must accept so that a handoff at ``max_model_len``
    tokens fits: the state's bytes, its token ids (prompt and replayed output) and Serve's default
    4 MiB for everything else in the message (sampling, stop strings, trace context, framing)."""
    return state_bytes(model, max_model_len) + 2 * _TOKEN_ID_BYTES * max_model_len + SERVE_DEFAULT_GRPC_LIMIT


def serve_replies_by_grpc() -> bool:
    """Whether this Ray Serve process sends requests and replies to other replicas over gRPC
    (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` or ``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``), where an
    object reference cannot travel in a reply (see the module docstring)."""
    from ray.serve._private import constants

    return bool(getattr(constants, "RAY_SERVE_USE_GRPC_BY_DEFAULT", False))


def put_state(data: bytes) -> Any:
    """A reference to ``data`` in the object store (``ray.ObjectRef``); called in a Ray worker."""
    import ray

    return ray.put(data)


def is_state_ref(state: Any) -> bool:
    """Whether ``state`` is a :func:`put_state` reference (else bytes or None)."""
    if state is None or isinstance(state, bytes):
        return False
    import ray

    return isinstance(state, ray.ObjectRef)


async def get_state(ref: Any, request_id: str) -> bytes:
    """The bytes behind a :func:`put_state` reference; HandoffLost when the object is gone."""
    from ray.exceptions import ObjectFetchTimedOutError, ObjectLostError, OwnerDiedError, RayError

    try:
        data = await ref
    except (ObjectLostError, OwnerDiedError, ObjectFetchTimedOutError) as e:
        raise HandoffLost(f"handoff of request {request_id} is lost from the object store ({type(e).__name__})") from e
    except RayError as e:
        raise HandoffLost(f"handoff of request {request_id} could not be fetched ({type(e).__name__}: {e})") from e
    if not isinstance(data, bytes):
        raise RuntimeError(f"handoff of request {request_id} holds {type(data).__name__}, not bytes (a bug)")
    return data
