"""Which backend a link uses: a pure function of the two offers.

Rule, in the order of the listener's preference list (default
``shm, torchdist, tcp, libp2p``), skipping anything either side denies or
does not offer:

* ``shm`` — both ends report the same host id (boot id + network namespace);
* ``torchdist`` — both ends have CUDA and NCCL (or both opt into gloo on CPU,
  which only exercises the code path: it is no faster than tcp here);
* ``tcp`` — the listener offers a TCP endpoint;
* ``libp2p`` — always possible: it rides the control stream itself.

If either side requires an encrypted data plane, ``shm`` and ``torchdist``
are refused (neither is ever sealed: a torch.distributed link carries prompts'
activations in clear, between hosts too) and ``tcp`` remains, sealed by both
ends whatever the hosts (:mod:`hetmesh.transport.sealed`), then ``libp2p``.
A ``torchdist`` link chosen without the flag says in its reason that it is
in clear. The returned :class:`Choice` carries a human-readable reason naming every
backend that was skipped and why: there is never a silent fallback.

Pure: no trio, no libp2p, no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from hetmesh.transport.frames import Offer


class Backend(enum.StrEnum):
    """A data-plane backend; the value is its name on the wire (offers, announcements)."""

    SHM = "shm"
    TORCHDIST = "torchdist"
    TCP = "tcp"
    LIBP2P = "libp2p"


# the default preference order, as wire strings
BACKENDS: Final[tuple[str, ...]] = tuple(b.value for b in Backend)


@dataclass(frozen=True, slots=True)
class Choice:
    backend: str
    reason: str
    endpoint: str  # where the dialer connects ("" for libp2p)


# the backends no link of which is ever sealed, and why that matters
_NEVER_SEALED: Final[dict[str, str]] = {
    "shm": "shm links are never sealed",
    "torchdist": "torch.distributed links are never sealed: activations would cross in clear",
}
_IN_CLEAR = "; in clear: torch.distributed links are never sealed"


def _why_not(backend: str, dialer: Offer, listener: Offer, endpoints: dict[str, str]) -> str:
    """Empty when ``backend`` is usable, else why not."""
    if backend not in BACKENDS:
        return "unknown backend"
    for side, offer in (("dialer", dialer), ("listener", listener)):
        if backend in offer.deny:
            return f"denied by the {side}"
        if backend not in offer.backends:
            return f"not offered by the {side}"
    if backend in _NEVER_SEALED and (dialer.require_encryption or listener.require_encryption):
        return f"an encrypted data plane is required ({_NEVER_SEALED[backend]})"
    if backend == "libp2p":
        return ""
    if not endpoints.get(backend):
        return "the listener gave no endpoint"
    if backend == "shm" and dialer.host_id != listener.host_id:
        return "different hosts"
    if backend == "torchdist" and not (
        (dialer.cuda and dialer.nccl and listener.cuda and listener.nccl)
        or (dialer.gloo and listener.gloo)
    ):
        return "no CUDA+NCCL on both ends (and gloo not enabled on both)"
    return ""


def choose_backend(dialer: Offer, listener: Offer) -> Choice:
    """The backend for the link ``dialer -> listener``; deterministic on both sides."""
    endpoints = dict(listener.endpoints)
    order = list(dict.fromkeys(listener.backends))
    order += [b for b in BACKENDS if b not in order]
    skipped: list[str] = []
    for backend in order:
        why = _why_not(backend, dialer, listener, endpoints)
        if not why:
            head = {
                "shm": "same host",
                "torchdist": (
                    "NCCL on both ends" if dialer.nccl and listener.nccl else "gloo enabled"
                )
                + _IN_CLEAR,
                "tcp": "direct TCP endpoint offered"
                + (
                    ", sealed: an encrypted data plane is required"
                    if dialer.require_encryption or listener.require_encryption
                    else ""
                ),
                "libp2p": "encrypted control stream",
            }[backend]
            tail = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            return Choice(backend, f"{backend}: {head}{tail}", endpoints.get(backend, ""))
        skipped.append(f"{backend}: {why}")
    return Choice("", "no usable backend: " + "; ".join(skipped), "")
