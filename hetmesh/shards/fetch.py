"""Serving and fetching a model's tensors between peers, over the data plane.

```
Serving.serve ── Shards (one per node, for the model it serves)
                   ├── links                /hetmesh/shards/link/1.0.0: tensors over the
                   │                        data plane (shm/tcp; hetmesh.shards.links)
                   ├── handle(stream)      /hetmesh/shards/1.0.0: one request, one reply
                   └── ensure(start, end)  before a stage loads: fetch what is missing
join_from_mesh(node, spec) ── a node with no model: the manifest and its small files
```

Tensors travel over a negotiated data-plane link (:mod:`hetmesh.shards.links`)
where the pair has a direct one; the libp2p protocol below is the fallback, and
carries the manifest and the small files of a joining node (before its data
plane is up). On the libp2p protocol a request is one msgpack frame
``{"manifest": id, "kind": "manifest" | "file" | "tensor", "name": str}``; the reply
is one frame, ``0x00`` + the bytes or ``0x01`` + a one-line error. Every length is
bounded by the manifest (a reply may not exceed the byte length the manifest gives
the thing asked for), so a peer cannot make us read more than we expect.

Fetching is verified and resumable (:mod:`hetmesh.shards.cache`): each tensor
is checked against its sha256 before it is written, atomically; tensors on disk
are never fetched again. Missing tensors are fetched ``parallel`` at a time, each
from the holders of its unit in rotation, so several holders serve at once. A
holder whose bytes do not match is counted and avoided for this model from then
on; a holder that fails (died, reset, timed out) is skipped for that tensor.

Raises :class:`~hetmesh.errors.ModelNotFound` (naming the units) when no live
peer holds what a stage needs; the caller (:mod:`hetmesh.node.serving`) logs it
and does not serve that stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import trio

from hetmesh.discovery import wire
from hetmesh.errors import CorruptModel, MeshError, ModelError, ModelNotFound
from hetmesh.resources import PeerId
from hetmesh.scheduler.announcement import read_serving
from hetmesh.scheduler.demand import MemberLoad, neediest
from hetmesh.shards import cache
from hetmesh.shards.links import DIRECT_UNAVAILABLE, ShardLinks
from hetmesh.shards.manifest import (
    Manifest,
    TensorEntry,
    is_manifest_id,
    side_files,
    tensors_for_units,
    unit_ranges,
    units_present,
)
from hetmesh.shards.serve import Span, checkpoint_span, file_span, read_span, write_span
from hetmesh.shards.serve_caps import BUSY, ServeCaps, reply_deadline_s

log = logging.getLogger(__name__)

SHARDS_PROTOCOL = "/hetmesh/shards/1.0.0"
MAX_REQUEST_BYTES = 4096
MAX_MANIFEST_BYTES = 32 * 2**20
MESH_MODEL = "mesh"  # ``--model mesh``: whatever model the mesh's peers announce
_OK, _ERROR = b"\x00", b"\x01"
_MIN_RATE_BPS = 256 * 1024  # a reply slower than this (plus a margin) has stalled
_PROGRESS_EVERY_S = 2.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShardStatistics:
    """What the node reports of its shards (status, ``/metrics``)."""

    manifest: str
    units_held: tuple[tuple[int, int], ...]
    bytes_fetched: int
    bytes_served: int
    tensors_fetched: int
    verification_failures: int
    fetching: bool
    fetch_done_bytes: int
    fetch_total_bytes: int
    fetch_rate_bps: float
    avoided_peers: tuple[PeerId, ...]
    missing: str  # the last ModelNotFound ("" when none)


def wants_mesh_model(spec: str | None) -> bool:
    """Whether ``--model`` asks for a model from the mesh (``mesh`` or a manifest id)."""
    return spec is not None and (spec == MESH_MODEL or is_manifest_id(spec))


class Shards:
    """One node's tensors of one model: what it serves to peers and fetches from them."""

    def __init__(
        self,
        discovery: Any,
        folder: Path,
        manifest: Manifest,
        *,
        partial: bool,
        parallel: int = 4,
        timeout_s: float = 600.0,
        holder_wait_s: float = 60.0,
    ) -> None:
        self.discovery = discovery
        self.folder = folder
        self.manifest = manifest
        self.manifest_id = manifest.id
        self.partial = partial  # a folder filled from peers (else a whole converted folder)
        self._by_name = {t.name: t for t in manifest.tensors}
        self._files = side_files(manifest)
        self._limiter = trio.CapacityLimiter(max(1, parallel))
        self._timeout_s = timeout_s
        self._holder_wait_s = holder_wait_s
        self._avoided: set[PeerId] = set()
        self._turn = 0
        self._held = self._scan() if partial else list(range(manifest.num_units))
        self.bytes_fetched = 0
        self.bytes_by_peer: dict[PeerId, int] = {}  # verified bytes stored, by the peer sending
        self.bytes_served = 0
        self.tensors_fetched = 0
        self.verification_failures = 0
        self._fetches = 0
        self._done = 0
        self._total = 0
        self._began = 0.0
        self._ended = 0.0
        self.missing = ""
        self.links: ShardLinks | None = None  # the data-plane path (attach_links)
        self.caps = ServeCaps()  # requests answered at once, both paths together

    def attach_links(self, host: Any, plane: Any) -> ShardLinks:
        """Fetch and serve tensors over data-plane links negotiated with ``plane`` (the
        caller registers the returned links' ``handle`` for their protocol)."""
        self.links = ShardLinks(host, plane, self._answer, self._count_served, self.caps)
        return self.links

    def _count_served(self, nbytes: int) -> None:
        self.bytes_served += nbytes

    # -- what we hold -----------------------------------------------------------

    def _scan(self) -> list[int]:
        present = [t.name for t in self.manifest.tensors if cache.has_tensor(self.folder, t)]
        return units_present(self.manifest, present)

    def units_held(self) -> tuple[tuple[int, int], ...]:
        return tuple(unit_ranges(self._held))

    def statistics(self) -> ShardStatistics:
        # the rate over the fetches so far: to now while one runs, else to when the last ended
        elapsed = (time.monotonic() if self._fetches else self._ended) - self._began
        return ShardStatistics(
            manifest=self.manifest_id,
            units_held=self.units_held(),
            bytes_fetched=self.bytes_fetched,
            bytes_served=self.bytes_served,
            tensors_fetched=self.tensors_fetched,
            verification_failures=self.verification_failures,
            fetching=self._fetches > 0,
            fetch_done_bytes=self._done,
            fetch_total_bytes=self._total,
            fetch_rate_bps=self._done / elapsed if elapsed > 0 else 0.0,
            avoided_peers=tuple(sorted(self._avoided)),
            missing=self.missing,
        )

    def counters(self) -> dict[str, float]:
        """The figures a node announces (``extra["shards"]``; status shows them per peer)."""
        stats = self.statistics()
        return {
            "bytes_fetched": stats.bytes_fetched,
            "bytes_served": stats.bytes_served,
            "verification_failures": stats.verification_failures,
            "fetching": float(stats.fetching),
            "fetch_done_bytes": stats.fetch_done_bytes,
            "fetch_total_bytes": stats.fetch_total_bytes,
            "fetch_rate_bps": stats.fetch_rate_bps,
            # of bytes_fetched, those that came over a direct data-plane link (not libp2p)
            "bytes_direct": sum(self.links.bytes_by_backend.values()) if self.links else 0,
        }

    # -- serving peers ----------------------------------------------------------

    async def handle(self, stream: Any) -> None:
        """Answer one request (the handler of :data:`SHARDS_PROTOCOL`) within the caps
        (:mod:`~hetmesh.shards.serve_caps`), streamed from disk (:mod:`~hetmesh.shards.serve`)."""
        peer = str(stream.muxed_conn.peer_id)
        if not self.caps.take(peer):
            with trio.move_on_after(5.0):
                await wire.write_frame(stream, _ERROR + BUSY.encode())
            return
        try:
            raw = await wire.read_frame(stream, max_bytes=MAX_REQUEST_BYTES, timeout_s=30.0)
            found: bytes | Span
            try:
                located = await trio.to_thread.run_sync(self._locate, wire.decode_map(raw))
                found = _OK + located if isinstance(located, bytes) else located
            except (MeshError, OSError) as exc:
                found = _ERROR + str(exc)[:500].encode()
            nbytes = len(found) if isinstance(found, bytes) else found.length
            with trio.move_on_after(reply_deadline_s(nbytes)) as writing:
                if isinstance(found, bytes):
                    await wire.write_frame(stream, found)
                else:  # streamed from disk, a chunk at a time
                    lie = self._lie if found.stored else bytes
                    await write_span(stream, _OK, found, lie)
            if writing.cancelled_caught:  # the requester does not read: drop it
                log.info("%s did not read its shard reply in time: dropped", peer)
                with contextlib.suppress(Exception):
                    await stream.reset()
                return
            if not isinstance(found, bytes):
                self.bytes_served += found.length
            elif found[:1] == _OK:
                self.bytes_served += len(found) - 1
        except (MeshError, OSError) as exc:  # the file went short mid-reply
            log.warning("a shard reply to %s failed: %s", peer, exc)
            with contextlib.suppress(Exception):
                await stream.reset()
        finally:
            self.caps.give_back(peer)

    def _answer(self, message: dict[str, Any]) -> bytes:
        """The bytes asked for, whole (the data-plane path: one frame);
        ``ModelNotFound`` for anything this node does not hold."""
        found = self._locate(message)
        if isinstance(found, bytes):
            return found
        data = read_span(found)
        return self._lie(data) if found.stored else data

    def _locate(self, message: dict[str, Any]) -> bytes | Span:
        """Where the bytes asked for lie on disk (the manifest: its bytes, prefixed as a
        reply); ``ModelNotFound`` for anything this node does not hold."""
        if message.get("manifest") != self.manifest_id:
            raise ModelNotFound(f"this node holds manifest {self.manifest_id}, not that one")
        kind, name = message.get("kind"), message.get("name")
        if kind == "manifest":
            return self.manifest.canonical()
        if kind == "file" and isinstance(name, str) and name in self._files:
            return file_span(self.folder / name)
        entry = self._by_name.get(name) if isinstance(name, str) else None
        if kind != "tensor" or entry is None:
            raise ModelNotFound(f"no {kind} {name!r} in this model")
        if self.partial:
            if not cache.has_tensor(self.folder, entry):
                raise ModelNotFound(f"{name} is not held here")
            return file_span(cache.tensor_path(self.folder, entry))
        return checkpoint_span(self.folder, entry.name)

    def _lie(self, data: bytes) -> bytes:
        """The bytes a holder sends (tests replace it to make a holder lie)."""
        return data

    # -- fetching from peers ----------------------------------------------------

    def holders(self, unit: int) -> list[PeerId]:
        """Live peers announcing this manifest with ``unit`` on disk (not avoided), sorted."""
        found = []
        for entry in self.discovery.alive():
            record = entry.record
            if record is None or entry.peer_id in self._avoided:
                continue
            state = read_serving(record.extra, plan_of=None)
            if state.manifest == self.manifest_id and any(
                a <= unit < b for a, b in state.units_held
            ):
                found.append(entry.peer_id)
        return sorted(found)

    async def ensure(self, start: int, end: int) -> None:
        """Make every tensor of stage ``[start, end)`` present here, fetching what lacks.

        Raises ``ModelNotFound`` naming the units no live peer holds (after waiting
        ``holder_wait_s`` for one to appear), ``CorruptModel`` when every holder of a
        tensor sent bad bytes, ``ModelError`` for a failed write.
        """
        if not self.partial:
            return
        wanted = [
            t for t in tensors_for_units(self.manifest, start, end) if t.name in self._by_name
        ]
        missing = [t for t in wanted if not cache.has_tensor(self.folder, t)]
        if missing:
            await self._wait_for_holders(missing, self._holder_wait_s)
            try:
                await self._fetch_all(missing, f"units [{start}, {end})")
            finally:
                if self.links is not None:
                    with trio.CancelScope(shield=True):
                        await self.links.aclose_idle()
        self._held = self._scan()

    async def _wait_for_holders(self, missing: Sequence[TensorEntry], wait_s: float) -> None:
        units = sorted({t.unit for t in missing})
        with trio.move_on_after(wait_s):
            while True:
                orphans = [u for u in units if not self.holders(u)]
                if not orphans:
                    self.missing = ""
                    return
                await trio.sleep(0.5)
        runs = ", ".join(f"[{a}, {b})" for a, b in unit_ranges(orphans))
        self.missing = f"no live peer holds units {runs} of {self.manifest.model}"
        raise ModelNotFound(f"{self.missing} (manifest {self.manifest_id[:12]})")

    async def _fetch_all(self, missing: Sequence[TensorEntry], what: str) -> None:
        total = sum(t.nbytes for t in missing)
        self._fetches += 1
        if self._fetches == 1:
            self._done, self._total, self._began = 0, 0, time.monotonic()
        self._total += total
        log.info(
            "fetching %s of %s: %d tensors, %d bytes",
            what,
            self.manifest.model,
            len(missing),
            total,
        )
        failures: list[BaseException] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._progress, what)
                async with trio.open_nursery() as workers:
                    for entry in sorted(missing, key=lambda t: -t.nbytes):
                        workers.start_soon(self._fetch_guarded, entry, failures)
                nursery.cancel_scope.cancel()
        finally:
            self._fetches -= 1
            self._ended = time.monotonic()
        if failures:
            raise failures[0]
        log.info("fetched %s of %s: %d bytes", what, self.manifest.model, total)

    async def _fetch_guarded(self, entry: TensorEntry, failures: list[BaseException]) -> None:
        try:
            await self._fetch_one(entry)
        except MeshError as exc:
            failures.append(exc)

    async def _progress(self, what: str) -> None:
        while True:
            await trio.sleep(_PROGRESS_EVERY_S)
            stats = self.statistics()
            log.info(
                "fetching %s: %.1f / %.1f MB at %.1f MB/s",
                what,
                stats.fetch_done_bytes / 1e6,
                stats.fetch_total_bytes / 1e6,
                stats.fetch_rate_bps / 1e6,
            )

    async def _fetch_one(self, entry: TensorEntry) -> None:
        """Fetch, verify and store one tensor, trying its holders in rotation until done."""
        deadline = trio.current_time() + self._timeout_s
        orphaned_since: float | None = None
        async with self._limiter:
            while trio.current_time() < deadline:
                holders = self.holders(entry.unit)
                if not holders:
                    # a loaded holder may be suspected for a moment: wait before giving up
                    now = trio.current_time()
                    orphaned_since = now if orphaned_since is None else orphaned_since
                    if now - orphaned_since > self._holder_wait_s:
                        raise ModelNotFound(
                            f"no live peer holds unit {entry.unit} of {self.manifest.model}"
                        )
                    await trio.sleep(0.5)
                    continue
                orphaned_since = None
                self._turn += 1
                shift = self._turn % len(holders)
                for peer in holders[shift:] + holders[:shift]:
                    if peer in self._avoided:
                        continue
                    data = await self._request(peer, "tensor", entry.name, entry.nbytes)
                    if data is None:
                        continue
                    if not cache.verify(data, nbytes=entry.nbytes, sha256=entry.sha256):
                        self._reject(peer, entry.name)
                        continue
                    await trio.to_thread.run_sync(cache.put_tensor, self.folder, entry, data)
                    self.bytes_fetched += len(data)
                    self.bytes_by_peer[peer] = self.bytes_by_peer.get(peer, 0) + len(data)
                    self._done += len(data)
                    self.tensors_fetched += 1
                    return
                await trio.sleep(1.0)  # every holder failed this round: they may come back
        raise CorruptModel(f"could not fetch {entry.name} from any holder in {self._timeout_s} s")

    @contextlib.asynccontextmanager
    async def open_scratch(self, start: int, end: int, root: Path) -> AsyncIterator[Path]:
        """A throw-away partial folder under ``root`` holding units ``[start, end)`` (fetched
        like a stage, from this node's folder where it has them): for calibration, so that
        the node's own cache keeps only the units it serves. Removed on exit.
        """
        import shutil
        import tempfile

        def prepare() -> tuple[Path, Path]:
            root.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(dir=root, prefix="calibration-"))
            try:
                folder = cache.open_folder(scratch, self.manifest, self.manifest_id)
                for entry in self.manifest.files:
                    if (self.folder / entry.name).is_file():
                        shutil.copyfile(self.folder / entry.name, folder / entry.name)
                for t in tensors_for_units(self.manifest, start, end):
                    if cache.has_tensor(self.folder, t):
                        shutil.copyfile(
                            cache.tensor_path(self.folder, t), cache.tensor_path(folder, t)
                        )
            except BaseException:
                shutil.rmtree(scratch, ignore_errors=True)
                raise
            return scratch, folder

        try:
            scratch, folder = await trio.to_thread.run_sync(prepare)
        except OSError as exc:
            raise ModelError(f"cannot make a scratch folder under {root}: {exc}") from exc
        try:
            helper = Shards(self.discovery, folder, self.manifest, partial=True)
            helper._avoided = self._avoided  # a liar found by either is avoided by both
            helper.links = self.links
            await helper.ensure(start, end)
            self.bytes_fetched += helper.bytes_fetched
            self.verification_failures += helper.verification_failures
            yield folder
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(lambda: shutil.rmtree(scratch, ignore_errors=True))

    def _reject(self, peer: PeerId, what: str) -> None:
        self.verification_failures += 1
        self._avoided.add(peer)
        log.warning("%s sent bytes of %s that do not match the manifest: avoiding it", peer, what)

    async def _request(self, peer: PeerId, kind: str, name: str, nbytes: int) -> bytes | None:
        """The bytes ``peer`` sends for (kind, name), or None if it failed (logged):
        over a direct data-plane link where the pair has one, else over libp2p."""
        if self.links is not None:
            message = {"manifest": self.manifest_id, "kind": kind, "name": name}
            timeout_s = 30.0 + nbytes / _MIN_RATE_BPS
            data = await self.links.request(peer, message, nbytes, timeout_s=timeout_s)
            if data is not DIRECT_UNAVAILABLE:
                assert data is None or isinstance(data, bytes)
                return data
        return await request_bytes(
            self.discovery, peer, self.manifest_id, kind, name, max_bytes=nbytes
        )


async def request_bytes(
    discovery: Any, peer: PeerId, manifest_id: str, kind: str, name: str, *, max_bytes: int
) -> bytes | None:
    """One request to ``peer``; its bytes, or None when the peer failed or refused (logged)."""
    message = {"manifest": manifest_id, "kind": kind, "name": name}
    timeout_s = 30.0 + max_bytes / _MIN_RATE_BPS
    try:
        reply: bytes = await discovery.request(
            peer,
            SHARDS_PROTOCOL,
            wire.encode(message),
            max_reply_bytes=max_bytes + 1,
            timeout_s=timeout_s,
        )
    except MeshError as exc:
        log.info("fetching %s %s from %s failed: %s", kind, name, peer, exc)
        return None
    if reply[:1] != _OK:
        log.info("%s refused %s %s: %s", peer, kind, name, reply[1:].decode(errors="replace"))
        return None
    return reply[1:]


def announced_manifests(discovery: Any) -> dict[str, list[PeerId]]:
    """Manifest id -> the live peers announcing it (sorted)."""
    found: dict[str, list[PeerId]] = {}
    for entry in discovery.alive():
        if entry.record is None:
            continue
        manifest = read_serving(entry.record.extra, plan_of=None).manifest
        if manifest:
            found.setdefault(manifest, []).append(entry.peer_id)
    return {k: sorted(v) for k, v in found.items()}


def manifest_loads(discovery: Any, seen: dict[str, list[PeerId]]) -> dict[str, list[MemberLoad]]:
    """Each manifest's holders' announced load (hetmesh.scheduler.demand)."""
    records = {e.peer_id: e.record for e in discovery.alive() if e.record is not None}
    return {
        manifest: [MemberLoad.of(records[p]) for p in holders if p in records]
        for manifest, holders in seen.items()
    }


async def join_from_mesh(
    discovery: Any, spec: str, cache_dir: Path, *, wait_s: float = 120.0
) -> Path:
    """A partial folder for the model ``spec`` names (``mesh`` or a manifest id), with its
    manifest, config and tokenizer fetched from a peer and verified; no tensors yet.

    Raises ``ModelNotFound`` when no peer announces such a model within ``wait_s``,
    ``CorruptModel`` when no peer sends a manifest or file that matches.
    """
    holders: list[PeerId] = []
    manifest_id = spec
    with trio.move_on_after(wait_s):
        while True:
            seen = announced_manifests(discovery)
            if spec == MESH_MODEL and seen:  # several: the one in most demand per member
                manifest_id = neediest(manifest_loads(discovery, seen))
                holders = seen[manifest_id]
            else:
                holders = seen.get(spec, [])
            if holders:
                break
            await trio.sleep(0.5)
    if not holders:
        what = "any model" if spec == MESH_MODEL else f"manifest {spec}"
        raise ModelNotFound(f"no peer of the mesh announced {what} within {wait_s:.0f} s")
    manifest = await _fetch_manifest(discovery, manifest_id, holders)
    folder = await trio.to_thread.run_sync(cache.open_folder, cache_dir, manifest, manifest_id)
    for entry in manifest.files:
        if (folder / entry.name).is_file():
            continue  # present means verified
        for peer in holders:
            data = await request_bytes(
                discovery, peer, manifest_id, "file", entry.name, max_bytes=entry.nbytes
            )
            if data is None:
                continue
            with contextlib.suppress(CorruptModel):  # a lying peer: try the next one
                await trio.to_thread.run_sync(
                    lambda d=data, e=entry: cache.put_file(
                        folder, e.name, d, nbytes=e.nbytes, sha256=e.sha256
                    )
                )
                break
        else:
            raise CorruptModel(f"no peer sent a {entry.name} matching manifest {manifest_id}")
    log.info("joined model %s (manifest %s) from the mesh", manifest.model, manifest_id[:12])
    return folder


async def _fetch_manifest(discovery: Any, manifest_id: str, holders: Sequence[PeerId]) -> Manifest:
    import json

    for peer in holders:
        data = await request_bytes(
            discovery, peer, manifest_id, "manifest", "", max_bytes=MAX_MANIFEST_BYTES
        )
        if data is None:
            continue
        try:
            manifest = Manifest.from_json(json.loads(data))
        except (ValueError, CorruptModel):
            log.warning("%s sent an unreadable manifest", peer)
            continue
        if manifest.id == manifest_id:
            return manifest
        log.warning("%s sent a manifest that does not hash to %s", peer, manifest_id)
    raise CorruptModel(f"no peer sent manifest {manifest_id}")


async def open_shards(discovery: Any, folder: Path, model: str) -> Shards | None:
    """The :class:`Shards` of the folder a node serves (None: it cannot be described)."""
    from hetmesh.partition.store import SHARDS_MARKER
    from hetmesh.shards.manifest import load_or_build

    partial = (folder / SHARDS_MARKER).is_file()

    def describe() -> Shards | None:
        try:
            if partial:
                manifest = cache.read_folder_manifest(folder)
            else:
                manifest = load_or_build(folder, model=model)
        except (OSError, ValueError, ModelError) as exc:
            log.warning("%s: cannot describe the model for peers: %s", folder, exc)
            return None
        return Shards(discovery, folder, manifest, partial=partial)

    return await trio.to_thread.run_sync(describe)


__all__ = [
    "MESH_MODEL",
    "SHARDS_PROTOCOL",
    "ShardStatistics",
    "Shards",
    "announced_manifests",
    "join_from_mesh",
    "open_shards",
    "request_bytes",
    "wants_mesh_model",
]
