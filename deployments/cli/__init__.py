"""The `deltaserve` command line: up, generate, tenants, cache."""

from deployments.cli.main import main

__all__ = ["main"]
