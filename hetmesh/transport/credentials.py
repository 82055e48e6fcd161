"""One-time data-plane credentials: HMAC challenge-response bound to both peer ids.

The listener issues a :class:`Credential` per negotiated link and hands it to
the dialer inside its offer, over the already-authenticated control stream.
On the data connection the dialer sends ``Hello(peer_id, credential_id,
nonce_d)``, the listener answers ``Challenge(nonce_l)``, the dialer proves
``mac(secret, "dialer", ids, nonces)`` and the listener proves back with the
``"listener"`` role, so each side knows the other holds the secret. A
credential is consumed on its first successful use; a second use is a replay.

Pure: no trio, no libp2p, no clock (expiry is the caller's business).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from typing import Final, Literal

DOMAIN: Final = b"hetmesh/link-credential/1"
NONCE_BYTES: Final = 32


@dataclass(frozen=True, slots=True)
class Credential:
    """A one-time secret for one link between ``dialer_id`` and ``listener_id``."""

    credential_id: bytes
    secret: bytes = field(repr=False)
    dialer_id: str
    listener_id: str


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def proof(
    credential: Credential,
    role: Literal["dialer", "listener"],
    dialer_nonce: bytes,
    listener_nonce: bytes,
) -> bytes:
    """The MAC one side sends: binds the role, both peer ids, the credential id, both nonces."""
    message = b"".join(
        _field(x)
        for x in (
            DOMAIN,
            role.encode(),
            credential.dialer_id.encode(),
            credential.listener_id.encode(),
            credential.credential_id,
            dialer_nonce,
            listener_nonce,
        )
    )
    return hmac.new(credential.secret, message, hashlib.sha256).digest()


def link_keys(
    credential: Credential, dialer_nonce: bytes, listener_nonce: bytes
) -> tuple[bytes, bytes]:
    """The two 256-bit keys of an encrypted link: (dialer -> listener, listener -> dialer).

    Derived from the credential's secret and both handshake nonces, under a
    label no proof uses, so a key never appears on the wire and each link (and
    each direction) gets its own.
    """

    def key(direction: bytes) -> bytes:
        message = b"".join(
            _field(x)
            for x in (
                b"hetmesh/link-key/v1",
                direction,
                credential.dialer_id.encode(),
                credential.listener_id.encode(),
                credential.credential_id,
                dialer_nonce,
                listener_nonce,
            )
        )
        return hmac.new(credential.secret, message, hashlib.sha256).digest()

    return key(b"dialer->listener"), key(b"listener->dialer")


def check(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(expected, got)


@dataclass(frozen=True, slots=True)
class CredentialStatistics:
    issued: int
    outstanding: int
    accepted: int
    refused_wrong: int
    refused_replay: int
    refused_unknown: int


class CredentialBook:
    """The listener's outstanding credentials (not thread-safe: use from one trio thread).

    ``verify`` returns the credential when the proof is right and consumes it;
    otherwise it returns ``None`` and counts why (wrong MAC, replay of a used
    credential, unknown id, or a dialer id that is not the one it was issued to).
    """

    def __init__(self, listener_id: str, *, max_remembered_used: int = 65536) -> None:
        self._listener_id = listener_id
        self._outstanding: dict[bytes, Credential] = {}
        self._used: dict[bytes, None] = {}
        self._max_used = max_remembered_used
        self._issued = self._accepted = 0
        self._wrong = self._replay = self._unknown = 0

    def issue(self, dialer_id: str) -> Credential:
        credential = Credential(
            secrets.token_bytes(16), secrets.token_bytes(32), dialer_id, self._listener_id
        )
        self._outstanding[credential.credential_id] = credential
        self._issued += 1
        return credential

    def lookup(self, credential_id: bytes) -> Credential | None:
        """The outstanding credential with this id, counting a replay or unknown id if none."""
        credential = self._outstanding.get(credential_id)
        if credential is None:
            if credential_id in self._used:
                self._replay += 1
            else:
                self._unknown += 1
        return credential

    def verify(
        self,
        credential_id: bytes,
        dialer_id: str,
        dialer_nonce: bytes,
        listener_nonce: bytes,
        mac: bytes,
    ) -> Credential | None:
        credential = self._outstanding.get(credential_id)
        if credential is None:
            if credential_id in self._used:
                self._replay += 1
            else:
                self._unknown += 1
            return None
        expected = proof(credential, "dialer", dialer_nonce, listener_nonce)
        if dialer_id != credential.dialer_id or not check(expected, mac):
            self._wrong += 1
            return None
        self.consume(credential_id)
        self._accepted += 1
        return credential

    def consume(self, credential_id: bytes) -> None:
        """Retire a credential (used, or its negotiation was abandoned)."""
        if self._outstanding.pop(credential_id, None) is not None:
            self._used[credential_id] = None
            while len(self._used) > self._max_used:
                del self._used[next(iter(self._used))]

    def statistics(self) -> CredentialStatistics:
        return CredentialStatistics(
            self._issued,
            len(self._outstanding),
            self._accepted,
            self._wrong,
            self._replay,
            self._unknown,
        )
