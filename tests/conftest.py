"""Shared fixtures. Tests run on CPU in fp32 unless marked `gpu`."""

from __future__ import annotations

import os

import pytest
import torch

torch.manual_seed(0)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of ``a`` against the reference ``b``."""
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")
