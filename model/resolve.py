"""Where a model name points: a preset or a checkpoint directory (torch-free, so the ingress can use it)."""

from __future__ import annotations

from pathlib import Path

from .presets import DEFAULT_MODEL, PRESETS, checkpoint_path
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer_from


def resolve_model(name_or_path: str | Path) -> tuple[str, Path | None]:
    """(kind, path): kind is "preset" (path None) or "checkpoint"."""
    name = str(name_or_path)
    if name in PRESETS:
        return "preset", None
    shipped = checkpoint_path(name)
    if shipped is not None:
        return "checkpoint", shipped
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        return "checkpoint", path
    raise ValueError(
        f"model {name!r} is neither a shipped checkpoint, a preset {sorted(PRESETS)}, "
        "nor a directory with a config.json"
    )


def load_tokenizer(name_or_path: str | Path = DEFAULT_MODEL) -> Tokenizer:
    """Byte tokenizer for presets and the tiny checkpoints; `tokenizer.json` when a checkpoint has one."""
    kind, path = resolve_model(name_or_path)
    return ByteTokenizer() if kind == "preset" else load_tokenizer_from(path)
