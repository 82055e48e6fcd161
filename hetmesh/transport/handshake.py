"""The credential handshake, written once for blocking and once for async framing.

Dialer: ``Hello`` -> (``Challenge``) -> ``Proof`` -> (``Proof``).
Listener: (``Hello``) -> ``Challenge`` -> (``Proof``) -> ``Proof`` or ``Error(AUTH)``.
Both raise :class:`AuthenticationFailed` when the peer cannot prove the
credential and :class:`RemoteProtocolError` for frames out of order.

Before the dialer has proven its credential a listener reads nothing but a
Hello or a Proof, each a few KiB at most (:data:`PREAUTH_LIMITS`,
:func:`check_preauth_head`): anything else is refused from its 16-byte
prefix, before a byte of it is buffered or allocated.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from hetmesh.errors import AuthenticationFailed, RemoteProtocolError
from hetmesh.transport.credentials import Credential, check, new_nonce, proof
from hetmesh.transport.frames import (
    ERROR_AUTH,
    PREFIX_BYTES,
    Challenge,
    Error,
    Frame,
    FrameHead,
    Hello,
    Limits,
    Proof,
    parse_header,
    parse_prefix,
)

#: Given the Hello and the listener's nonce and the dialer's MAC, the verified credential or None.
Verifier = Callable[[Hello, bytes, bytes], Credential | None]


_F = TypeVar("_F", bound=Frame)

#: What an unauthenticated peer may make a listener read: small heads, no payload.
PREAUTH_LIMITS = Limits(
    max_header_bytes=4096,
    max_payload_bytes=0,
    max_tensors=0,
    max_items=0,
    max_string_bytes=1024,
)


def check_preauth_head(prefix: bytes | bytearray | memoryview) -> FrameHead:
    """Check the prefix of a frame from a peer not yet authenticated.

    Only a Hello or a Proof within :data:`PREAUTH_LIMITS` passes; anything
    else raises :class:`RemoteProtocolError` (the caller closes the
    connection without reading on).
    """
    head = parse_prefix(prefix, PREAUTH_LIMITS)
    if head.cls is not Hello and head.cls is not Proof:
        raise RemoteProtocolError(f"{head.cls.__name__} before authentication")
    return head


def parse_preauth(data: bytes | bytearray | memoryview) -> Frame:
    """A whole pre-authentication frame (prefix + header, nothing after it), checked
    as above; :class:`RemoteProtocolError` for anything else."""
    head = check_preauth_head(data)
    header = memoryview(data)[PREFIX_BYTES:]
    if len(header) != head.header_bytes:
        raise RemoteProtocolError("frame head length does not match its prefix")
    return parse_header(head, header, PREAUTH_LIMITS).build()


def _expect(frame: Frame, cls: type[_F]) -> _F:
    if isinstance(frame, Error) and frame.code == ERROR_AUTH:
        raise AuthenticationFailed(f"peer refused the credential: {frame.message}")
    if not isinstance(frame, cls):
        raise RemoteProtocolError(f"expected {cls.__name__}, got {type(frame).__name__}")
    return frame


def dial_blocking(
    send: Callable[[Frame], object], receive: Callable[[], Frame], credential: Credential
) -> tuple[bytes, bytes]:
    """Prove ``credential`` to the listener; the (dialer, listener) nonces used."""
    nonce = new_nonce()
    send(Hello(peer_id=credential.dialer_id, credential_id=credential.credential_id, nonce=nonce))
    challenge = _expect(receive(), Challenge)
    send(Proof(mac=proof(credential, "dialer", nonce, challenge.nonce)))
    reply = _expect(receive(), Proof)
    if not check(proof(credential, "listener", nonce, challenge.nonce), reply.mac):
        raise AuthenticationFailed("the listener could not prove the credential")
    return nonce, challenge.nonce


def listen_blocking(
    send: Callable[[Frame], object], receive: Callable[[], Frame], verify: Verifier
) -> tuple[Credential, Hello]:
    hello = _expect(receive(), Hello)
    nonce = new_nonce()
    send(Challenge(nonce=nonce))
    mac = _expect(receive(), Proof).mac
    credential = verify(hello, nonce, mac)
    if credential is None:
        send(Error(code=ERROR_AUTH, message="credential refused"))
        raise AuthenticationFailed(f"peer {hello.peer_id!r} failed the credential check")
    send(Proof(mac=proof(credential, "listener", hello.nonce, nonce)))
    return credential, hello


async def dial_async(
    send: Callable[[Frame], Awaitable[object]],
    receive: Callable[[], Awaitable[Frame]],
    credential: Credential,
) -> None:
    nonce = new_nonce()
    await send(
        Hello(peer_id=credential.dialer_id, credential_id=credential.credential_id, nonce=nonce)
    )
    challenge = _expect(await receive(), Challenge)
    await send(Proof(mac=proof(credential, "dialer", nonce, challenge.nonce)))
    reply = _expect(await receive(), Proof)
    if not check(proof(credential, "listener", nonce, challenge.nonce), reply.mac):
        raise AuthenticationFailed("the listener could not prove the credential")


async def listen_async(
    send: Callable[[Frame], Awaitable[object]],
    receive: Callable[[], Awaitable[Frame]],
    verify: Verifier,
) -> tuple[Credential, Hello, bytes]:
    """Check the dialer's proof; the credential, its Hello and our (listener) nonce."""
    hello = _expect(await receive(), Hello)
    nonce = new_nonce()
    await send(Challenge(nonce=nonce))
    mac = _expect(await receive(), Proof).mac
    credential = verify(hello, nonce, mac)
    if credential is None:
        await send(Error(code=ERROR_AUTH, message="credential refused"))
        raise AuthenticationFailed(f"peer {hello.peer_id!r} failed the credential check")
    await send(Proof(mac=proof(credential, "listener", hello.nonce, nonce)))
    return credential, hello, nonce
