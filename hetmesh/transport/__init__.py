"""Transport: frames, the tensor codec (sans-IO) and the data-plane backends.

Knows bytes and tensors, never policy. The node daemon's API::

    from hetmesh.transport import DataPlaneConfig, open_data_plane, Activations

    async with open_data_plane(DataPlaneConfig(peer_id=my_id)) as plane:
        # over an authenticated control stream (libp2p: wrap with Libp2pStream)
        link = await plane.connect(control_stream)     # we dial   (or:)
        link = await plane.accept(control_stream)      # they dial
        await link.send(Activations(session_id="s", step=0, positions=(0, 1), tensors=(h,)))
        frame = await link.receive()        # tensors read into pooled / shared memory
        ...use frame.tensors...
        link.release(frame)                 # give the buffers back
        link.statistics()                   # backend, reason, counters, buffer occupancy
        await link.aclose()                 # sends Goodbye

Links are long-lived and shared by many sessions (frames carry the session
id). One task may send while another receives; sends are serialised. Every
backend subclasses the abstract :class:`~hetmesh.transport.links.Link`, whose
docstring is the contract (errors, cancellation, counters) and which
``tests/unit/transport/test_link_conformance.py`` checks for each backend.
``ShmLink.allocate(dtype, shape)`` gives a tensor already in shared memory
(the zero-copy path on one host).

Backend choice (:func:`choose_backend`, pure): same host -> ``shm``; both
ends CUDA+NCCL -> ``torchdist``; a TCP endpoint -> ``tcp``; otherwise
``libp2p`` (the control stream itself, encrypted). The reason is logged and
kept in ``link.reason`` / ``DataPlane.statistics().choices``.

Errors: :class:`~hetmesh.errors.StreamReset` (peer gone, also mid-frame),
:class:`~hetmesh.errors.AuthenticationFailed` (credential refused),
:class:`~hetmesh.errors.PeerUnreachable` / :class:`~hetmesh.errors.ConnectTimeout`
(no link), :class:`~hetmesh.errors.RemoteProtocolError` (malformed input).
Each is fatal to one link only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetmesh.transport.credentials import Credential, CredentialBook
    from hetmesh.transport.dataplane import (
        DataPlane,
        DataPlaneConfig,
        DataPlaneStatistics,
        open_data_plane,
    )
    from hetmesh.transport.frames import (
        Activations,
        Cancel,
        Decoder,
        Error,
        Frame,
        Goodbye,
        KVBlock,
        Limits,
        Offer,
        Tokens,
        encode,
    )
    from hetmesh.transport.links import Link, LinkMode, LinkStatistics
    from hetmesh.transport.negotiation import Backend, Choice, choose_backend
    from hetmesh.transport.p2p import Libp2pStream

# Every name loads on first use: the I/O half (trio, sockets, libp2p) so that the
# pure modules never pull trio or libp2p, and the frames (torch) so that a module of
# this package that needs neither (gate, used by discovery's probes) does not pull
# torch into a membership-only node
_LAZY = {
    "Credential": "credentials",
    "CredentialBook": "credentials",
    "Activations": "frames",
    "Cancel": "frames",
    "Decoder": "frames",
    "Error": "frames",
    "Frame": "frames",
    "Goodbye": "frames",
    "KVBlock": "frames",
    "Limits": "frames",
    "Offer": "frames",
    "Tokens": "frames",
    "encode": "frames",
    "Backend": "negotiation",
    "Choice": "negotiation",
    "choose_backend": "negotiation",
    "DataPlane": "dataplane",
    "DataPlaneConfig": "dataplane",
    "DataPlaneStatistics": "dataplane",
    "open_data_plane": "dataplane",
    "Link": "links",
    "LinkMode": "links",
    "LinkStatistics": "links",
    "Libp2pStream": "p2p",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hetmesh.transport' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"hetmesh.transport.{module}"), name)


__all__ = [
    "Activations",
    "Backend",
    "Cancel",
    "Choice",
    "Credential",
    "CredentialBook",
    "DataPlane",
    "DataPlaneConfig",
    "DataPlaneStatistics",
    "Decoder",
    "Error",
    "Frame",
    "Goodbye",
    "KVBlock",
    "Libp2pStream",
    "Limits",
    "Link",
    "LinkMode",
    "LinkStatistics",
    "Offer",
    "Tokens",
    "choose_backend",
    "encode",
    "open_data_plane",
]
