"""The manifest of a converted model folder: what the mesh calls "the model".

A manifest lists the model's small files (config, tokenizer) and every stored
tensor with the unit it belongs to, its stored dtype, shape, byte length and
sha256. Its canonical JSON form hashes to the **manifest id**, the identity
two nodes compare before trusting each other's bytes: equal ids mean equal
weights, byte for byte.

Units follow :mod:`hetmesh.partition.profile`: 0 is the embedding, ``1..L``
the decoder layers, ``L + 1`` the final norm and head. With tied embeddings the
head reads the embedding's matrix, so :func:`tensors_for_units` gives a range
holding the head the embedding's tensors too.

Building a manifest reads and hashes every tensor once (about a second for
the default model); :func:`load_or_build` keeps it next to the weights, keyed
by the weight files' sizes and modification times.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetmesh.errors import CorruptModel, ModelError
from hetmesh.partition.checkpoint import read_safetensors_header

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
MANIFEST_FILE = "hetmesh-manifest.json"
# The small files a node needs besides tensors (whichever the folder has).
SIDE_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
MAX_SIDE_FILE_BYTES = 64 * 2**20
MAX_TENSORS = 1 << 16
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class FileEntry:
    """One small file of the model (config, tokenizer)."""

    name: str
    nbytes: int
    sha256: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """One stored tensor: its unit, safetensors dtype, shape, byte length and sha256."""

    name: str
    unit: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sha256: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """A model's content: ``model`` (its key), ``num_units``, files and tensors (sorted)."""

    model: str
    num_units: int
    tied_embeddings: bool
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest_version": MANIFEST_VERSION,
            "model": self.model,
            "num_units": self.num_units,
            "tied_embeddings": self.tied_embeddings,
            "files": [[f.name, f.nbytes, f.sha256] for f in self.files],
            "tensors": [
                [t.name, t.unit, t.dtype, list(t.shape), t.nbytes, t.sha256] for t in self.tensors
            ],
        }

    def canonical(self) -> bytes:
        """The bytes whose sha256 is :attr:`id` (sorted keys, no spaces)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @property
    def id(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()

    @classmethod
    def from_json(cls, raw: object) -> Manifest:
        """Parse (and bound-check) a manifest; ``CorruptModel`` if it is malformed."""
        try:
            if not isinstance(raw, dict) or raw.get("manifest_version") != MANIFEST_VERSION:
                raise ValueError("unknown manifest version")
            files = tuple(
                FileEntry(name=_file_name(n), nbytes=_count(b), sha256=_hex(h))
                for n, b, h in raw["files"]
            )
            if len(raw["tensors"]) > MAX_TENSORS:
                raise ValueError("too many tensors")
            num_units = _count(raw["num_units"])
            tensors = tuple(
                TensorEntry(
                    name=str(n),
                    unit=_unit(u, num_units),
                    dtype=str(d),
                    shape=tuple(_count(x) for x in s),
                    nbytes=_count(b),
                    sha256=_hex(h),
                )
                for n, u, d, s, b, h in raw["tensors"]
            )
            return cls(
                model=str(raw["model"]),
                num_units=num_units,
                tied_embeddings=bool(raw["tied_embeddings"]),
                files=files,
                tensors=tensors,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptModel(f"malformed model manifest ({exc})") from exc

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


def unit_of(name: str, num_layers: int) -> int:
    """The unit a stored tensor belongs to (suffixes like ``.q4_1.qs`` do not matter)."""
    if name.startswith("model.embed_tokens."):
        return 0
    found = _LAYER.match(name)
    if found is not None:
        layer = int(found.group(1))
        if layer >= num_layers:
            raise CorruptModel(f"tensor {name} names layer {layer} of {num_layers}")
        return layer + 1
    if name.startswith(("model.norm.", "lm_head.")):
        return num_layers + 1
    raise CorruptModel(f"tensor {name} belongs to no unit")


def tensors_for_units(manifest: Manifest, start: int, end: int) -> list[TensorEntry]:
    """The tensors a stage ``[start, end)`` loads (the embedding's too for a tied head)."""
    units = set(range(start, end))
    head = manifest.num_units - 1
    has_head_matrix = any(
        t.unit == head and t.name.startswith("lm_head.") for t in manifest.tensors
    )
    if head in units and not has_head_matrix:
        units.add(0)  # the tied head reads the embedding
    return [t for t in manifest.tensors if t.unit in units]


def unit_ranges(units: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted unit indices as maximal ``[start, end)`` runs."""
    runs: list[tuple[int, int]] = []
    for u in sorted(set(units)):
        if runs and runs[-1][1] == u:
            runs[-1] = (runs[-1][0], u + 1)
        else:
            runs.append((u, u + 1))
    return runs


def units_present(manifest: Manifest, present: Iterable[str]) -> list[int]:
    """The units all of whose own tensors are among the names in ``present``."""
    have = set(present)
    missing = {t.unit for t in manifest.tensors if t.name not in have}
    return [u for u in range(manifest.num_units) if u not in missing]


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where the data of a safetensors file starts, and its parsed header (tensors only)."""
    try:
        with open(path, "rb") as handle:
            start, header = read_safetensors_header(handle, path)
    except OSError as exc:
        raise CorruptModel(f"{path}: unreadable safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    return start, header


def build_manifest(folder: Path, *, model: str | None = None) -> Manifest:
    """Hash ``folder``'s side files and every stored tensor into its manifest.

    Raises ``CorruptModel`` for an unreadable folder.
    """
    from hetmesh.partition.store import check_model_dir, weight_files

    config = check_model_dir(folder)
    layers = int(config["num_hidden_layers"])
    files = [
        FileEntry(
            name=name, nbytes=(folder / name).stat().st_size, sha256=file_sha256(folder / name)
        )
        for name in SIDE_FILES
        if (folder / name).is_file()
    ]
    tensors: list[TensorEntry] = []
    for path in sorted(set(weight_files(folder).values())):
        base, header = safetensors_header(path)
        with open(path, "rb") as handle:
            for name in sorted(header):
                info = header[name]
                begin, stop = (int(v) for v in info["data_offsets"])
                handle.seek(base + begin)
                data = handle.read(stop - begin)
                if len(data) != stop - begin:
                    raise CorruptModel(f"{path}: shorter than its header says ({name})")
                tensors.append(
                    TensorEntry(
                        name=name,
                        unit=unit_of(name, layers),
                        dtype=str(info["dtype"]),
                        shape=tuple(int(n) for n in info["shape"]),
                        nbytes=len(data),
                        sha256=hashlib.sha256(data).hexdigest(),
                    )
                )
    tensors.sort(key=lambda t: t.name)
    return Manifest(
        model=model or folder.name,
        num_units=layers + 2,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        files=tuple(files),
        tensors=tuple(tensors),
    )


def load_or_build(folder: Path, *, model: str | None = None) -> Manifest:
    """The manifest of a full converted folder, built once and kept beside the weights."""
    from hetmesh.partition.store import weight_files

    stamp = {
        p.name: [p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(set(weight_files(folder).values()))
    }
    cached = folder / MANIFEST_FILE
    try:
        raw = json.loads(cached.read_text())
        if raw.get("stamp") == stamp:
            manifest = Manifest.from_json(raw["manifest"])
            if model is None or manifest.model == model:
                return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CorruptModel):
        pass
    manifest = build_manifest(folder, model=model)
    try:  # a read-only model folder simply builds it again next time
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stamp": stamp, "manifest": manifest.to_json()}))
        os.replace(tmp, cached)
    except OSError as exc:
        log.debug("cannot keep the manifest in %s: %s", folder, exc)
    return manifest


def local_holding(folder: Path, *, model: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """What a node announces of ``folder``: (manifest id, unit runs held); ("", []) if unknown.

    Never raises: a folder that cannot be described is served as before, just
    not offered to peers (logged).
    """
    try:
        manifest = load_or_build(folder, model=model)
        from hetmesh.partition.store import weight_files

        present = weight_files(folder)
    except (OSError, ValueError, KeyError, TypeError, ModelError) as exc:
        log.warning("%s: cannot describe the model for peers: %s", folder, exc)
        return "", []
    return manifest.id, unit_ranges(units_present(manifest, present))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_manifest_id(text: str) -> bool:
    return bool(_HEX64.match(text))


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


def _unit(value: object, num_units: int) -> int:
    unit = _count(value)
    if unit >= num_units:
        raise ValueError(f"unit {unit} outside [0, {num_units})")
    return unit


def _hex(value: object) -> str:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise ValueError("not a sha256")
    return value


def _file_name(value: object) -> str:
    if not isinstance(value, str) or value not in SIDE_FILES:
        raise ValueError(f"unexpected model file {value!r}")
    return value


def side_files(manifest: Manifest) -> Mapping[str, FileEntry]:
    return {f.name: f for f in manifest.files}


__all__ = [
    "MANIFEST_FILE",
    "FileEntry",
    "Manifest",
    "TensorEntry",
    "build_manifest",
    "file_sha256",
    "is_manifest_id",
    "load_or_build",
    "local_holding",
    "safetensors_header",
    "side_files",
    "tensors_for_units",
    "unit_of",
    "unit_ranges",
    "units_present",
]
