"""What one peer's shm links may map here, over all of them together (hetmesh.transport.shm)."""

from __future__ import annotations

import threading


class PeerMappings:
    """Segments and bytes mapped from each peer over all its shm links (thread-safe:
    links map on their reader threads). Refuses past ``max_segments`` / ``max_bytes``
    a peer; a link gives its share back when it shuts down."""

    def __init__(self, max_segments: int, max_bytes: int) -> None:
        self.max_segments = max_segments
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, int]] = {}  # peer -> (segments, bytes)

    def take(self, peer: str, segments: int, nbytes: int) -> bool:
        with self._lock:
            held_segments, held_bytes = self._held.get(peer, (0, 0))
            if held_segments + segments > self.max_segments:
                return False
            if held_bytes + nbytes > self.max_bytes:
                return False
            self._held[peer] = (held_segments + segments, held_bytes + nbytes)
            return True

    def give_back(self, peer: str, segments: int, nbytes: int) -> None:
        with self._lock:
            held_segments, held_bytes = self._held.pop(peer, (0, 0))
            left = (held_segments - segments, held_bytes - nbytes)
            if left[0] > 0:
                self._held[peer] = left

    def held(self, peer: str) -> tuple[int, int]:
        with self._lock:
            return self._held.get(peer, (0, 0))
