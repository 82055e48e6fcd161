"""A model cache for synth tests: empty but for the default model (linked, not pulled)."""

from __future__ import annotations

from pathlib import Path


def synth_cache(root: Path, default_model_dir: Path) -> Path:
    """A fresh cache under ``root`` whose default model is the shared one (its tokenizer
    is what a synth folder copies), so nothing is downloaded."""
    from hetmesh.partition.store import DEFAULT_MODEL, _models_root

    cache = root / "cache"
    models = _models_root(cache)
    models.mkdir(parents=True)
    (models / DEFAULT_MODEL).symlink_to(default_model_dir, target_is_directory=True)
    return cache
