"""The membership protocol's messages as msgpack maps (pure, no I/O).

A message is one map with one-letter keys (short on purpose:
they travel several times a second). Rumors are lists, not maps:
``[peer_id, health, boot_id, incarnation, record_seq, addrs]``, and a seventh
item, the accuser, on suspicions that name one. Decoding is
strict: anything malformed raises :class:`~hetmesh.errors.RemoteProtocolError`,
and so does a counter past its bound (:data:`MAX_COUNTER`, incarnations
:data:`MAX_INCARNATION`): a member cannot push a node's own counters past what
its next message can carry.
"""

from __future__ import annotations

from typing import Any

import msgpack

from hetmesh.discovery.membership import Kind, Message, Update
from hetmesh.discovery.membership_types import MAX_COUNTER, MAX_INCARNATION
from hetmesh.discovery.table import Health
from hetmesh.discovery.wire import MAX_ANNOUNCEMENT_BYTES, Announcement, decode_announcement
from hetmesh.errors import RemoteProtocolError

MEMBERSHIP_PROTOCOL = "/hetmesh/membership/1.0.0"
MAX_MESSAGE_BYTES = MAX_ANNOUNCEMENT_BYTES + 64 * 1024
MAX_UPDATES = 64
_HEALTH = {Health.ALIVE: 0, Health.SUSPECT: 1, Health.DEAD: 2, Health.LEFT: 3}
_HEALTH_OF = {v: k for k, v in _HEALTH.items()}


def encode_message(msg: Message) -> bytes:
    data: dict[str, Any] = {
        "k": int(msg.kind),
        "s": msg.src,
        "d": msg.dst,
        "b": msg.src_boot,
        "i": msg.src_incarnation,
        "r": msg.src_record_seq,
    }
    if msg.seq:
        data["n"] = msg.seq
    if msg.target:
        data["t"] = msg.target
    if msg.updates:
        data["u"] = [_rumor(u) for u in msg.updates]
    if msg.src_addrs:
        data["a"] = list(msg.src_addrs)
    if msg.record_blob:  # signed: the origin's exact bytes travel, so the signature holds
        data["R"] = msg.record_blob
        data["S"] = msg.signature
    elif msg.record is not None:
        data["R"] = msg.record.to_wire()
    out = msgpack.packb(data, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def _rumor(u: Update) -> list[Any]:
    item = [u.peer_id, _HEALTH[u.health], u.boot_id, u.incarnation, u.record_seq, list(u.addrs)]
    return [*item, u.accuser] if u.accuser else item


def _int(value: Any, where: str, limit: int = MAX_COUNTER) -> int:
    if type(value) is not int or value < 0:
        raise RemoteProtocolError(f"membership message: {where} is not a count: {value!r}")
    if value > limit:
        raise RemoteProtocolError(f"membership message: {where} {value} is over {limit}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RemoteProtocolError(f"membership message: {where} is not text: {value!r}")
    return value


def _addrs(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > 16:
        raise RemoteProtocolError(f"membership message: bad {where}")
    return tuple(_str(a, where) for a in value)


def _update(item: Any) -> Update:
    if not isinstance(item, list) or len(item) not in (6, 7):
        raise RemoteProtocolError("membership message: a rumor is not a 6- or 7-item list")
    peer, health, boot, inc, seq, addrs = item[:6]
    accuser = _str(item[6], "rumor accuser") if len(item) == 7 else ""
    if health not in _HEALTH_OF:
        raise RemoteProtocolError(f"membership message: unknown health {health!r}")
    return Update(
        _str(peer, "rumor peer"),
        _HEALTH_OF[health],
        _int(boot, "rumor boot"),
        _int(inc, "rumor incarnation", MAX_INCARNATION),
        _int(seq, "rumor record seq"),
        _addrs(addrs, "rumor addrs"),
        accuser,
    )


def decode_message(payload: bytes) -> Message:
    """Parse one message, or raise :class:`RemoteProtocolError`."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise RemoteProtocolError(f"membership message of {len(payload)} bytes is too big")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise RemoteProtocolError(f"undecodable membership message: {exc}") from exc
    if not isinstance(data, dict):
        raise RemoteProtocolError("membership message: not a map")
    try:
        kind = Kind(data["k"])
        updates = data.get("u", [])
        if not isinstance(updates, list) or len(updates) > MAX_UPDATES:
            raise RemoteProtocolError("membership message: bad rumor list")
        record = None
        blob = signature = b""
        if isinstance(data.get("R"), bytes):
            blob = data["R"]
            signature = data.get("S", b"")
            if not isinstance(signature, bytes):
                raise RemoteProtocolError("membership message: the signature is not bytes")
            record = decode_announcement(blob)
        elif "R" in data:
            try:
                record = Announcement.from_wire(data["R"])
            except (ValueError, TypeError) as exc:
                raise RemoteProtocolError(f"membership message: bad record: {exc}") from exc
        return Message(
            kind,
            _str(data["s"], "src"),
            _str(data["d"], "dst"),
            _int(data["b"], "boot"),
            _int(data["i"], "incarnation", MAX_INCARNATION),
            _int(data["r"], "record seq"),
            seq=_int(data.get("n", 0), "seq"),
            target=_str(data.get("t", ""), "target"),
            updates=tuple(_update(u) for u in updates),
            src_addrs=_addrs(data.get("a", []), "addrs"),
            record=record,
            record_blob=blob,
            signature=signature,
        )
    except (KeyError, ValueError) as exc:
        raise RemoteProtocolError(f"malformed membership message: {exc!r}") from exc


__all__ = ["MAX_MESSAGE_BYTES", "MEMBERSHIP_PROTOCOL", "decode_message", "encode_message"]
