"""A few fp32 rows of a linear layer in MKL's own order, at a matrix-vector's speed.

On AMD's EPYC (Zen 4) torch's ``F.linear`` (MKL 2024.2) computes every output of a
call of 12 rows or more, or of a multiple of 4, the same way: the inputs cut into
blocks of 192 from the first, a block's products summed by one fused
multiply-add chain in order, the blocks' sums added in order (measured on every
element for K of 576 to 4,096, 4 to 512 rows, up to 49,152 outputs, 1 and 2
threads, the weight row- or column-major). A lone row (a decode step) takes
another kernel with other bits, so the exact fp32 way padded it to 4 rows: a
decode step then cost ~1.4x torch's (issue 44, item 5). ``exact_kernel.c`` sums
in that very order, 16 outputs per vector (AVX-512; 8 with AVX2), up to
:data:`KERNEL_ROWS` rows per call: a lone row gets the bits a large call gives it, as fast as
torch's own matrix-vector kernel (one thread against its two).

The C source is built at first use by the system compiler (``$HETMESH_CC``, else
``cc``; ``-O3 -march=native -ffp-contract=off``, never fast-math) into the user's
cache dir (``kernels/``, named by the source's, compiler's and CPU's hash) and
loaded with ctypes. Then :func:`kernel_block` proves it once per process: random
rows of a few shapes must equal ``F.linear``'s bits in a 16-row call, for the
first of :data:`BLOCKS` that holds everywhere. No compiler, a failed build, a
build without a vector path (its plain loop sums in the same order, but no faster
than padding), or no block that holds: the exact way pads as before, said once
in the log.
``HETMESH_EXACT_KERNEL=0`` (read at the first probe) turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("exact_kernel.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
BLOCKS = (192, 256, 128, 384, 512, 96, 64)  # inputs per chain, tried in order by the probe
KERNEL_ROWS = 8  # rows a call to the kernel may have (the C loops over passes)
# rows of a layer's call the kernel takes: one pass over the weight (AVX-512 8, AVX2 4;
# set by the probe), more by MKL (two passes cost more than F.linear's call)
ROWS = KERNEL_ROWS
# the probe's shapes (out, in): the default model's, a ragged one, a small one
PROBE_SHAPES = ((576, 576), (1536, 576), (576, 1536), (77, 700), (96, 2048), (40, 64))

_LIB: ctypes.CDLL | None = None
_BLOCK: int | None = None  # the process's verdict: 0 none, else inputs per chain


def compiler() -> str:
    """The C compiler the kernel is built with: ``$HETMESH_CC``, else ``cc``."""
    return os.environ.get("HETMESH_CC", "cc")


def _machine() -> str:
    """What ``-march=native`` builds for: the architecture, the CPU's model and flags."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line
            elif line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}"


def library_path(cc: str | None = None) -> Path:
    """Where the built kernel is cached for this source, compiler and CPU. Raises
    OSError (FileNotFoundError where the compiler is missing) or
    subprocess.SubprocessError where the compiler cannot be asked its version."""
    from hetmesh.partition.store import default_cache_dir

    cc = cc or compiler()
    version = subprocess.run(
        [cc, "--version"], capture_output=True, check=True, timeout=60, text=True
    ).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cc.encode(), version.encode(), _machine().encode()):
        key.update(part)
        key.update(b"\0")
    key.update(" ".join(FLAGS).encode())
    return default_cache_dir() / "kernels" / f"exact_kernel-{key.hexdigest()[:24]}.so"


def build(cc: str | None = None) -> Path:
    """The kernel's shared library, built here first if the cache has none (atomically:
    processes building at once each write their own file, the last one's stays).
    Raises OSError or subprocess.SubprocessError where it cannot be built."""
    cc = cc or compiler()
    path = library_path(cc)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, timeout=300, text=True
        )
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, cc, done.stdout, done.stderr)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _load() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(build()))
        c_long, ptr = ctypes.c_long, ctypes.c_void_p
        lib.hm_rows.argtypes = [ptr, c_long, c_long, ptr, c_long, c_long, c_long]
        lib.hm_rows.argtypes += [ptr, c_long, c_long, c_long, c_long]
        lib.hm_rows.restype = None
        for name in ("hm_width", "hm_pass"):
            getattr(lib, name).argtypes = []
            getattr(lib, name).restype = ctypes.c_int
        _LIB = lib
    return _LIB


def fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel can compute ``rows @ weight.T``: fp32 on the CPU, the weight's
    rows contiguous (row-major or sliced by rows), at most :data:`KERNEL_ROWS` rows."""
    return (
        rows.dtype == torch.float32
        and weight.dtype == torch.float32
        and rows.device.type == "cpu"
        and weight.device.type == "cpu"
        and rows.dim() == 2
        and 0 < rows.shape[0] <= KERNEL_ROWS
        and weight.dim() == 2
        and weight.stride(1) == 1
        and weight.stride(0) >= weight.shape[1]
        and rows.shape[1] == weight.shape[1]
    )


def kernel_rows(rows: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """``rows @ weight.T`` (``rows`` [m, in], m <= :data:`KERNEL_ROWS`; see :func:`fits`)
    by the kernel, each chain ``block`` inputs long. The tensors must stay alive and
    unchanged through the call (the GIL is released in it)."""
    lib = _load()
    rows = rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    lib.hm_rows(
        rows.data_ptr(), m, k, weight.data_ptr(), n, k, weight.stride(0),
        out.data_ptr(), n, block, 0, n,
    )  # fmt: skip
    return out


def kernel_block() -> int:
    """The inputs per chain with which the kernel gives rows ``F.linear``'s bits on this
    machine (proven once per process, :func:`_probe`), 0 where none holds, the kernel
    cannot be built or ``HETMESH_EXACT_KERNEL=0``."""
    global _BLOCK, ROWS
    if _BLOCK is None:
        _BLOCK = 0
        if os.environ.get("HETMESH_EXACT_KERNEL", "1") == "0":
            log.info("exact fp32 kernel off (HETMESH_EXACT_KERNEL=0): a lone row is padded")
        else:
            _BLOCK = _probe()
            if _BLOCK:
                ROWS = min(KERNEL_ROWS, _load().hm_pass())
    return _BLOCK


def _probe() -> int:
    try:
        lib = _load()
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        log.warning(
            "exact fp32 kernel not built (%s: %s): a lone row is padded", compiler(), detail
        )
        return 0
    if lib.hm_width() < 8:  # the plain loop: no faster than F.linear padded to 4
        log.warning("exact fp32 kernel built without a vector path: a lone row is padded")
        return 0
    g = torch.Generator().manual_seed(11)
    cases = []
    with torch.no_grad():
        for n, k in PROBE_SHAPES:
            w = torch.randn(n, k, generator=g)
            x = torch.randn(16, k, generator=g)
            cases.append((x, w, F.linear(x, w)))  # a 16-row call: the class of every call
        for block in BLOCKS:
            if all(
                torch.equal(kernel_rows(x[:m], w, block), ref[:m])
                for x, w, ref in cases
                for m in (1, 3, KERNEL_ROWS)
            ):
                width, rows = lib.hm_width(), lib.hm_pass()
                log.info(
                    "exact fp32 kernel: chains of %d inputs, %d outputs a vector, calls of"
                    " up to %d rows",
                    block, width, rows,
                )  # fmt: skip
                return block
    log.warning(
        "exact fp32 kernel: no chain length gives F.linear's bits here: a lone row is padded"
    )
    return 0


def reset() -> None:
    """Forget the process's verdict (tests: a probe again, e.g. under another compiler)."""
    global _BLOCK, _LIB, ROWS
    _BLOCK = None
    _LIB = None
    ROWS = KERNEL_ROWS


__all__ = [
    "BLOCKS",
    "KERNEL_ROWS",
    "build",
    "compiler",
    "fits",
    "kernel_block",
    "kernel_rows",
    "library_path",
    "reset",
]
