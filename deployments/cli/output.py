"""Where a command writes its results: checked before the work, so that a profile or a simulation that ran for
minutes does not end in a traceback about its output path."""

from __future__ import annotations

import tempfile
from pathlib import Path


def check_writable(path: Path, *, directory: bool = False) -> None:
    """ValueError naming ``path`` unless a file can be written there (``directory``: files under it). Creates
    nothing: the deepest directory of ``path`` that exists must take a new file, and nothing on the way may be a
    file."""
    path = Path(path).absolute()
    if not directory and path.is_dir():
        raise ValueError(f"cannot write {path}: it is a directory")
    where = path if directory else path.parent
    existing = next(p for p in (where, *where.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"cannot write {'under ' if directory else ''}{path}: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"cannot write {'under ' if directory else ''}{path}: {e.strerror or e}") from None
