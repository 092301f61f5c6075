"""What every model-holding replica does first: threads, weights, tokenizer, identity."""

from __future__ import annotations

import os
import socket

import torch

from model import load_model, load_tokenizer
from model.network import KimiForCausalLM
from model.tokenizer import Tokenizer

from .config import PlatformConfig


def replica_id() -> str:
    """Serve's replica id inside a replica, else host:pid."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (in-process use, tests)
        return f"{socket.gethostname()}:{os.getpid()}"


def load_replica_model(config: PlatformConfig) -> tuple[KimiForCausalLM, Tokenizer]:
    torch.set_num_threads(config.torch_threads)
    return load_model(config.model), load_tokenizer(config.model)


def stop_token_ids(tokenizer: Tokenizer, *, chat: bool) -> tuple[int, ...]:
    """End-of-sequence ids (and the end-of-turn marker for chat) for the byte tokenizer or an HF one."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if chat:
        end = getattr(tokenizer, "special_ids", {}).get("<|im_end|>")
        if end is not None:
            ids.append(end)
    return tuple(ids)
