"""The `deltaserve` command line (`deployments.cli.main` holds the parsers and every command)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The `deltaserve` entry point. It imports :mod:`deployments.cli.main` when called, not when this package
    is imported, so that `python -m deployments.cli.main` runs that module once, as ``__main__``."""
    from deployments.cli.main import main as run

    return run(argv)


__all__ = ["main"]
