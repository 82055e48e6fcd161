"""Records bound to their origin: each record version signed with the origin's key.

A record relayed or pulled from a holder arrives over that holder's
connection, so the connection authenticates the holder, not the record. The
origin signs the record's exact bytes with its libp2p identity key (the key
its peer id is derived from, ed25519); every receiver checks the signature
against the key inside the peer id the record names. A member can pass a
record on, never change or invent one.

Beyond the signature, a record is refused (not trimmed) when it names
devices of another peer or links measured from another peer: an honest node
never publishes those.
"""

from __future__ import annotations

from typing import Any

import msgpack

from hetmesh.discovery import wire
from hetmesh.discovery.wire import Announcement
from hetmesh.errors import RemoteProtocolError

_DOMAIN = b"hetmesh/record/v1\x00"  # a record signature never doubles as another signature


def sign_record(private_key: Any, blob: bytes) -> bytes:
    """The origin's signature over a record's encoded bytes (``wire.encode(record)``)."""
    signature = private_key.sign(_DOMAIN + blob)
    return bytes(signature)


def _public_key(peer_id: str) -> Any:
    from libp2p.peer.id import ID

    try:
        return ID.from_base58(peer_id).extract_public_key()
    except Exception as exc:  # not base58, or an id that does not inline its key
        raise RemoteProtocolError(f"record of {peer_id!r}: no public key in the peer id") from exc


def open_record(blob: bytes, signature: bytes) -> Announcement:
    """Parse a signed record and check it is its origin's own; or raise.

    Raises :class:`RemoteProtocolError` for undecodable or ill-typed bytes, a
    missing or wrong signature, and a record naming another peer's devices
    or links.
    """
    record = wire.decode_announcement(blob)
    check_own(blob, record)
    key = _public_key(record.peer_id)
    try:
        valid = bool(key.verify(_DOMAIN + blob, signature))
    except Exception as exc:
        raise RemoteProtocolError(f"record of {record.peer_id}: bad signature: {exc}") from exc
    if not valid:
        raise RemoteProtocolError(f"record of {record.peer_id}: the signature is not its origin's")
    return record


def check_own(blob: bytes, record: Announcement) -> None:
    """Refuse a record whose raw devices or links belong to another peer."""
    raw = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    for device in raw.get("devices") or ():
        if not isinstance(device, dict) or device.get("peer_id") != record.peer_id:
            raise RemoteProtocolError(f"record of {record.peer_id} names another peer's device")
    for link in raw.get("links") or ():
        if not isinstance(link, dict) or link.get("src") != record.peer_id:
            raise RemoteProtocolError(f"record of {record.peer_id} names another peer's link")


__all__ = ["check_own", "open_record", "sign_record"]
