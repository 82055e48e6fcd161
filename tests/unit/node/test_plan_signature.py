"""Plans are signed and checked with the peers' libp2p identity keys (ed25519)."""

from __future__ import annotations

from libp2p import generate_new_ed25519_identity
from libp2p.peer.id import ID

from hetmesh.node.serving import verify_signature


def test_verify_signature_accepts_the_signer_only() -> None:
    signer, other = generate_new_ed25519_identity(), generate_new_ed25519_identity()
    signer_id = ID.from_pubkey(signer.public_key).to_base58()
    other_id = ID.from_pubkey(other.public_key).to_base58()
    message = b"hetmesh/plan/v1\x00{}"
    signature = signer.private_key.sign(message)
    assert verify_signature(signer_id, message, signature)
    assert not verify_signature(other_id, message, signature)  # another peer's key
    assert not verify_signature(signer_id, message + b" ", signature)  # another message
    assert not verify_signature(signer_id, message, bytes(64))  # a made-up signature
    assert not verify_signature(signer_id, message, b"")
    assert not verify_signature("not-a-peer-id", message, signature)
    assert not verify_signature("", message, signature)
