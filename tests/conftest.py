"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a safetensors folder.

    Pulled once into the user's hetmesh cache ($HETMESH_HOME or the XDG cache),
    so later runs reuse it; a clean cache costs one offline pull (~30 s).
    """
    from hetmesh.partition.store import resolve_model

    return resolve_model()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests where CUDA is absent (torch is imported only if any exist)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)
