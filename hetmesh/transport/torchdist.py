"""torch.distributed links: a private two-rank process group per link (gloo or NCCL).

No ``init_process_group``: the listener (rank 0) binds a socket itself and
passes it to ``TCPStore(master_listen_fd=...)`` so the store listens only on
the data-plane address, never on every interface; it sends the store's port
to the dialer (rank 1) over the already-authenticated TCP connection, and
stops taking connections as soon as the group is formed (a socket filter
drops every new SYN; the store's connections already made, the authenticated
peer's among them, carry on): the store takes no connection from anyone else
for the life of the link. Both build ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (both ends CUDA) directly on a ``PrefixStore`` for this link.

Frame headers keep travelling on the authenticated TCP connection; each
tensor's bytes go through ``pg.send`` / ``pg.recv`` into a pooled buffer
(a device buffer with NCCL). A dead peer shows up as EOF on the TCP
connection or a ``RuntimeError`` from gloo; both become :class:`StreamReset`.
NCCL operations are issued from one thread per direction under a lock, as
several communicators on one GPU deadlock otherwise (TORCHDIST.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import socket
import struct
import threading
from typing import Any

import torch
import torch.distributed as dist

from hetmesh.errors import PeerUnreachable, StreamReset
from hetmesh.transport.codec import DTYPES, host_tensor
from hetmesh.transport.frames import Decision, Frame, Limits, encode
from hetmesh.transport.links import BufferedReader, ThreadedLink, sendmsg_all
from hetmesh.transport.negotiation import Backend

_TAG = 0
_NCCL_LOCK = threading.Lock()


def nccl_available() -> bool:
    return bool(torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available())


def _group(store: Any, rank: int, timeout_s: float, host: str, device: str | None) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if device is not None and device.startswith("cuda"):
        # 3 (the default) tears the whole process down on a link error.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        torch.cuda.set_device(torch.device(device))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.is_high_priority_stream = False
        pg = dist.ProcessGroupNCCL(store, rank, 2, options)
        pg.eager_connect_single_device(torch.device(device))
        return pg
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def listen_group(
    sock: socket.socket, link_id: str, host: str, timeout_s: float, device: str | None
) -> tuple[Any, Any]:
    """Rank 0 (blocking): start a store on ``host``, tell the dialer its port, build the group."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    # our own handle on the store's listening socket, to stop it listening later
    handle = socket.socket(fileno=os.dup(listener.fileno()))
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host,
            port,
            2,
            True,
            datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        sendmsg_all(
            sock,
            [memoryview(p) for p in encode(Decision(backend="torchdist", reason=f"{host}:{port}"))],
        )
        prefixed = dist.PrefixStore(  # type: ignore[attr-defined]
            f"hetmesh/link/{link_id}/", store
        )
        try:
            group = _group(prefixed, 0, timeout_s, host, device)
        except RuntimeError as exc:
            raise PeerUnreachable(f"torchdist group setup failed: {exc}") from exc
    finally:
        # formed (the dialer's store client connected before its rank could join) or
        # failed: either way nobody else may connect; the connections it accepted keep
        # working
        try:
            drop_new_connections(handle)
        except OSError:  # no socket filters here: refuse by shutting down (the loop spins)
            with contextlib.suppress(OSError):
                handle.shutdown(socket.SHUT_RDWR)
        handle.close()
    return group, store


SO_ATTACH_FILTER = 26  # Linux, <asm-generic/socket.h>
_DROP_ALL = struct.pack("HBBI", 0x06, 0, 0, 0)  # classic BPF: BPF_RET|BPF_K 0, keep nothing


def drop_new_connections(listener: socket.socket) -> None:
    """Make a listening TCP socket ignore every new connection attempt (its SYNs are
    dropped: a dialer sees no answer and times out); connections it already accepted,
    and the socket's owner, are untouched.

    Not ``shutdown``: a listening socket shut down under the store's libuv loop stays
    readable forever, and that loop spun a whole core retrying ``accept`` for the life
    of every link this node listened for (measured: 100 % of a core while idle).
    """
    program = (ctypes.c_ubyte * len(_DROP_ALL)).from_buffer_copy(_DROP_ALL)
    # struct sock_fprog {unsigned short len; struct sock_filter *filter;}
    fprog = struct.pack("HP", 1, ctypes.addressof(program))
    listener.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def dial_group(
    reader: BufferedReader, link_id: str, host: str, timeout_s: float, device: str | None
) -> tuple[Any, Any]:
    """Rank 1 (blocking): read the store endpoint from the listener and join the group."""
    frame = reader.read_frame()
    if not isinstance(frame, Decision) or frame.backend != "torchdist":
        raise PeerUnreachable("listener did not send a torchdist store endpoint")
    store_host, _, port = frame.reason.rpartition(":")
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            store_host, int(port), 2, False, datetime.timedelta(seconds=timeout_s)
        )
        prefixed = dist.PrefixStore(  # type: ignore[attr-defined]
            f"hetmesh/link/{link_id}/", store
        )
        return _group(prefixed, 1, timeout_s, host, device), store
    except (RuntimeError, ValueError) as exc:
        raise PeerUnreachable(f"torchdist group setup failed: {exc}") from exc


class TorchDistLink(ThreadedLink):
    """Headers on the TCP connection, payloads through the process group."""

    backend = Backend.TORCHDIST

    def __init__(
        self,
        sock: socket.socket,
        reader: BufferedReader,
        pg: Any,
        store: Any,
        rank: int,
        remote_peer_id: str,
        limits: Limits,
        device: str | None = None,
    ) -> None:
        super().__init__(remote_peer_id, limits)
        self.sock = sock
        self._reader_io = reader
        self._reader_io._pool = self.pool
        self._pg = pg
        self._store = store
        self._peer = 1 - rank
        self._device = device
        self._lock = _NCCL_LOCK if device and device.startswith("cuda") else threading.Lock()
        self.reason = "gloo" if device is None else "nccl"

    def _payload(self, t: torch.Tensor) -> torch.Tensor:
        if self._device is None:
            return host_tensor(t).reshape(-1).view(torch.uint8)
        return t.to(self._device).contiguous().reshape(-1).view(torch.uint8)

    def _write_blocking(self, frame: Frame) -> int:
        parts = encode(frame, self.limits)
        sendmsg_all(self.sock, [memoryview(parts[0])])
        total = len(parts[0])
        try:
            for t in frame.tensors_():
                payload = self._payload(t)
                if payload.numel():
                    with self._lock:
                        work = self._pg.send([payload], self._peer, _TAG)
                    work.wait()
                    del work
                total += payload.numel()
        except RuntimeError as exc:
            raise StreamReset(f"torchdist send failed: {exc}") from exc
        return total

    def _read_frame_blocking(self) -> Frame:
        pending = self._reader_io.read_pending()
        buffers: list[torch.Tensor] = []
        try:
            for spec in pending.specs:
                if self._device is None:
                    buffer = self.pool.acquire(spec)
                else:
                    buffer = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=self._device)
                buffers.append(buffer)
                if spec.nbytes:
                    raw = buffer.reshape(-1).view(torch.uint8)
                    with self._lock:
                        work = self._pg.recv([raw], self._peer, _TAG)
                    work.wait()
                    del work
        except RuntimeError as exc:
            for b in buffers:
                self.pool.release(b)
            raise StreamReset(f"torchdist receive failed: {exc}") from exc
        except BaseException:
            for b in buffers:
                self.pool.release(b)
            raise
        return pending.build(buffers)

    def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with contextlib.suppress(Exception):
            self._pg.abort()
        self._pg = None
        self._store = None


__all__ = ["TorchDistLink", "dial_group", "listen_group", "nccl_available"]
