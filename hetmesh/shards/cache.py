"""A partial model folder, filled from peers one verified tensor at a time.

```
<cache>/models/shards/<manifest id>/<model>/
    hetmesh-shards.json     {"manifest_id": ..., "manifest": {...}}   (written first)
    config.json, tokenizer.json, ...                                   (verified)
    tensors/<name>          one stored tensor's raw bytes               (verified)
```

Every file is written to a temporary name in the same folder and renamed
into place only after its bytes matched the manifest's sha256, so a file that
exists is whole and verified: an interrupted fetch resumes with what is
there, and a failed write (a full disk) leaves no file that looks complete.
The folder's name is the model's, so the node serving it announces the same
model key as the peers it fetched from. :mod:`hetmesh.partition.store` and
:class:`~hetmesh.partition.checkpoint.CheckpointReader` read such a folder
like any other, with only the tensors present so far.

No trio, no network: :mod:`hetmesh.shards.fetch` drives it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from hetmesh.errors import CorruptModel, ModelError
from hetmesh.partition.store import SHARD_TENSORS, SHARDS_MARKER, brief_error
from hetmesh.shards.manifest import Manifest, TensorEntry

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")


def shard_folder(cache: Path, manifest_id: str, model: str) -> Path:
    """Where the partial folder of ``manifest_id`` lives under ``cache``."""
    return cache / "models" / "shards" / manifest_id / _safe(model)


def open_folder(cache: Path, manifest: Manifest, manifest_id: str) -> Path:
    """The partial folder for ``manifest`` (made on first use); ``CorruptModel`` if the
    manifest does not hash to ``manifest_id``."""
    if manifest.id != manifest_id:
        raise CorruptModel(f"manifest hashes to {manifest.id}, not the {manifest_id} asked for")
    folder = shard_folder(cache, manifest_id, manifest.model)
    (folder / SHARD_TENSORS).mkdir(parents=True, exist_ok=True)
    marker = folder / SHARDS_MARKER
    if not marker.is_file():
        data = json.dumps({"manifest_id": manifest_id, "manifest": manifest.to_json()}).encode()
        write_atomically(marker, data)
    return folder


def read_folder_manifest(folder: Path) -> Manifest:
    """The manifest a partial folder was made for."""
    try:
        raw = json.loads((folder / SHARDS_MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise CorruptModel(f"{folder}: unreadable shard list ({brief_error(exc)})") from exc
    return Manifest.from_json(raw.get("manifest") if isinstance(raw, dict) else None)


def tensor_path(folder: Path, entry: TensorEntry) -> Path:
    return folder / SHARD_TENSORS / _safe(entry.name)


def has_tensor(folder: Path, entry: TensorEntry) -> bool:
    """Whether ``entry`` is already here (present means verified: see the module)."""
    path = tensor_path(folder, entry)
    return path.is_file() and path.stat().st_size == entry.nbytes


def verify(data: bytes, *, nbytes: int, sha256: str) -> bool:
    return len(data) == nbytes and hashlib.sha256(data).hexdigest() == sha256


def put_tensor(folder: Path, entry: TensorEntry, data: bytes) -> None:
    """Store ``data`` as ``entry`` after checking it; ``CorruptModel`` if it does not match."""
    if not verify(data, nbytes=entry.nbytes, sha256=entry.sha256):
        raise CorruptModel(f"bytes of {entry.name} do not match the manifest")
    write_atomically(tensor_path(folder, entry), data)


def put_file(folder: Path, name: str, data: bytes, *, nbytes: int, sha256: str) -> None:
    """Store a side file (config, tokenizer) after checking it against the manifest."""
    if not verify(data, nbytes=nbytes, sha256=sha256):
        raise CorruptModel(f"bytes of {name} do not match the manifest")
    write_atomically(folder / _safe(name), data)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, flush it, then rename it over.

    Raises ``ModelError`` (a full disk, a read-only cache) with nothing left at ``path``.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ModelError(f"cannot write {path}: {brief_error(exc)}") from exc


def _safe(name: str) -> str:
    """A tensor or model name as a file name (refusing anything that could leave the folder)."""
    if not _SAFE_NAME.match(name) or ".." in name:
        raise CorruptModel(f"unusable name {name!r} in a model manifest")
    return name


__all__ = [
    "has_tensor",
    "open_folder",
    "put_file",
    "put_tensor",
    "read_folder_manifest",
    "shard_folder",
    "tensor_path",
    "verify",
    "write_atomically",
]
