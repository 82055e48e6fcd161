"""Backend choice, credentials, and the import boundary of the pure modules."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from hetmesh.transport.credentials import Credential, CredentialBook, new_nonce, proof
from hetmesh.transport.frames import Offer
from hetmesh.transport.negotiation import choose_backend

ALL = ("shm", "torchdist", "tcp", "libp2p")
EP = (("shm", "sock"), ("tcp", "10.0.0.1:5"), ("torchdist", "10.0.0.1:5"))


def _offer(**kw: object) -> Offer:
    base: dict[str, Any] = {"peer_id": "p", "host_id": "h1", "backends": ALL, "endpoints": EP}
    base.update(kw)
    return Offer(**base)


@pytest.mark.parametrize(
    ("dialer", "listener", "backend", "why"),
    [
        (_offer(), _offer(), "shm", "same host"),
        (_offer(host_id="h2"), _offer(), "tcp", "shm: different hosts"),
        (
            _offer(host_id="h2", cuda=True, nccl=True),
            _offer(cuda=True, nccl=True),
            "torchdist",
            "NCCL",
        ),
        (_offer(host_id="h2", cuda=True, nccl=True), _offer(cuda=True), "tcp", "no CUDA+NCCL"),
        (_offer(host_id="h2", gloo=True), _offer(gloo=True), "torchdist", "gloo"),
        (
            _offer(host_id="h2"),
            _offer(endpoints=()),
            "libp2p",
            "tcp: the listener gave no endpoint",
        ),
        (_offer(), _offer(deny=("shm",)), "tcp", "shm: denied by the listener"),
        (_offer(deny=("shm", "tcp")), _offer(), "libp2p", "tcp: denied by the dialer"),
        (_offer(require_encryption=True), _offer(), "tcp", "shm: an encrypted data plane is"),
        (
            _offer(host_id="h2", cuda=True, nccl=True),
            _offer(cuda=True, nccl=True, require_encryption=True),
            "tcp",
            "torchdist: an encrypted data plane is required (torch.distributed links are never",
        ),
        (
            _offer(require_encryption=True, backends=("shm", "torchdist", "libp2p")),
            _offer(),
            "libp2p",
            "encrypted data plane is required",
        ),
        (_offer(host_id="h2", gloo=True), _offer(gloo=True), "torchdist", "in clear"),
        (_offer(), _offer(backends=("tcp", "shm", "libp2p")), "tcp", "direct TCP"),
        (_offer(backends=("tcp",)), _offer(), "tcp", "shm: not offered by the dialer"),
        (_offer(backends=("shm",), host_id="h2"), _offer(backends=("shm",)), "", "no usable"),
    ],
)
def test_choose_backend_rule(dialer: Offer, listener: Offer, backend: str, why: str) -> None:
    choice = choose_backend(dialer, listener)
    assert choice.backend == backend
    assert why in choice.reason
    assert choice.endpoint == dict(listener.endpoints).get(backend, "")


def test_choose_backend_is_deterministic_for_both_sides() -> None:
    a, b = _offer(host_id="x"), _offer(host_id="y", deny=("tcp",))
    assert choose_backend(a, b) == choose_backend(a, dataclasses.replace(b))


def _credential(book: CredentialBook) -> Credential:
    return book.issue("dialer")


def test_credential_accepts_once_then_counts_replay() -> None:
    book = CredentialBook("listener")
    c = _credential(book)
    dn, ln = new_nonce(), new_nonce()
    mac = proof(c, "dialer", dn, ln)
    assert book.verify(c.credential_id, "dialer", dn, ln, mac) == c
    assert book.verify(c.credential_id, "dialer", dn, ln, mac) is None
    stats = book.statistics()
    assert (stats.accepted, stats.refused_replay, stats.outstanding) == (1, 1, 0)


def test_credential_refuses_wrong_secret_wrong_peer_and_unknown_id() -> None:
    book = CredentialBook("listener")
    c = _credential(book)
    dn, ln = new_nonce(), new_nonce()
    forged = dataclasses.replace(c, secret=b"x" * 32)
    assert book.verify(c.credential_id, "dialer", dn, ln, proof(forged, "dialer", dn, ln)) is None
    assert book.verify(c.credential_id, "mallory", dn, ln, proof(c, "dialer", dn, ln)) is None
    # a MAC for the listener role or other nonces is not a dialer proof
    assert book.verify(c.credential_id, "dialer", dn, ln, proof(c, "listener", dn, ln)) is None
    assert book.verify(c.credential_id, "dialer", dn, ln, proof(c, "dialer", ln, dn)) is None
    assert book.verify(b"nope", "dialer", dn, ln, b"") is None
    stats = book.statistics()
    assert (stats.refused_wrong, stats.refused_unknown, stats.accepted) == (4, 1, 0)
    assert book.verify(c.credential_id, "dialer", dn, ln, proof(c, "dialer", dn, ln)) == c


def test_proof_binds_both_peer_ids() -> None:
    c = Credential(b"i" * 16, b"s" * 32, "a", "b")
    swapped = Credential(b"i" * 16, b"s" * 32, "b", "a")
    n = new_nonce()
    assert proof(c, "dialer", n, n) != proof(swapped, "dialer", n, n)


def test_pure_modules_import_neither_trio_nor_libp2p() -> None:
    code = (
        "import sys\n"
        "import hetmesh.transport.frames, hetmesh.transport.codec\n"
        "import hetmesh.transport.negotiation, hetmesh.transport.credentials\n"
        "import hetmesh.transport.sealed, hetmesh.transport.readers\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('trio', 'libp2p')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
