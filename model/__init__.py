"""The Kimi-K3-family network: config, layers, weights, state, tokenizer, runner.

Public API (a contract other parts and outside checks rely on)::

    load_model(name_or_path, dtype=torch.float32) -> KimiForCausalLM   # .forward(ids [B,T]) -> logits [B,T,V]
    load_tokenizer(name_or_path) -> Tokenizer                           # .encode(str) / .decode(ids)
    save_model(model, path, format=None, max_shard_bytes=None)

``name_or_path`` is a shipped checkpoint name (``k3-tiny``, the default), a preset
(``tiny-k3``, ``tiny-linear``: random weights, seed 0) or a directory with an HF
``config.json`` and safetensors weights.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import ModelConfig
from .presets import DEFAULT_MODEL
from .resolve import load_tokenizer, resolve_model

# what needs torch loads on first use (PEP 562): a process that only tokenizes (the ingress, the CLI)
# never imports it
_LAZY = {"load_model": "loading", "save_model": "loading", "KimiForCausalLM": "network"}

__all__ = sorted(["DEFAULT_MODEL", "ModelConfig", "load_tokenizer", "resolve_model", *_LAZY])


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
