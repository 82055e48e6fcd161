"""Hostile maps into every record decoder a stranger or member reaches above the bytes.

The byte-level decoders (discovery framing, data-plane frames, membership
messages) have their own fuzz tests beside their modules. Here Hypothesis
builds *decoded* maps, valid records with one field swapped for a hostile
value (NaN, inf, huge or negative integers, wrong types, deep nesting), and
feeds them to the decoders of announcements (``Announcement.from_wire`` and
``read_serving``), the generate request (the libp2p RPC's and the HTTP
body's parsers) and the session control RPC. Each must parse or raise its
boundary's error (``RemoteProtocolError``, ``InvalidRequest``, an HTTP 4xx),
and what it parses must be sane: finite, bound to its sender, encodable
again. Each test runs ``HETMESH_FUZZ_EXAMPLES`` examples (10,000 by default),
drawn from ``random.Random(seed)`` in plain Python: Hypothesis drawing nested
maps cost far more than the decoders under test. A failure names its seed,
which rebuilds the example exactly; the seeds start somewhere new each run.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from typing import Any

import msgpack

from hetmesh.discovery import wire
from hetmesh.discovery.wire import Announcement, KnownPeer, Load
from hetmesh.errors import InvalidRequest, RemoteProtocolError
from hetmesh.node.api_requests import ApiError, parse_api_request
from hetmesh.node.control import CloseSession, OpenSession, Reply, parse_request
from hetmesh.protocol.generate import GenerateRequest, SamplingParams
from hetmesh.resources import DeviceProfile, LinkProfile
from hetmesh.scheduler.announcement import (
    Calibration,
    ServedStage,
    ServingAnnouncement,
    read_serving,
    serving_extra,
    serving_stages,
)

EXAMPLES = int(os.environ.get("HETMESH_FUZZ_EXAMPLES", "10000"))

# values a hostile peer can put in any msgpack/JSON slot
_EDGE_INTS = (2**63, 2**64, 2**64 - 1, -(2**63) - 1, 0, -1)
_EDGE_FLOATS = (math.nan, math.inf, -math.inf, 1e308, 5e-324, 1e-45, -0.0)
_CHARS = "aZ0_-./:é\u2603\x00\U0001f600 "  # ascii, an accent, a snowman, NUL, an emoji


def _text(rng: random.Random, most: int) -> str:
    return "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, most)))


def _scalar(rng: random.Random) -> Any:
    kind = rng.randrange(8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-(2**70), 2**70) if rng.random() < 0.5 else rng.randint(-9, 9)
    if kind == 3:
        return rng.choice(_EDGE_INTS)
    if kind == 4:
        return rng.uniform(-1e6, 1e6) if rng.random() < 0.5 else rng.choice(_EDGE_FLOATS)
    if kind == 5:
        return rng.choice(_EDGE_FLOATS)
    if kind == 6:
        return _text(rng, 12)
    return rng.randbytes(rng.randint(0, 12))


def hostile(rng: random.Random, depth: int = 0) -> Any:
    """A scalar, or (two levels deep at most) a list or map of hostile values."""
    kind = rng.randrange(4) if depth < 2 else 0
    if kind <= 1:
        return _scalar(rng)
    if kind == 2:
        return [hostile(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {_text(rng, 8): hostile(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _mutated(rng: random.Random, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with up to three keys given hostile values, up to two dropped, and
    maybe one key added."""
    keys = sorted(base)
    changes = {rng.choice(keys): hostile(rng) for _ in range(rng.randint(0, 3))}
    dropped = set(rng.sample(keys, min(len(keys), rng.randint(0, 2))))
    extra = {_text(rng, 6): hostile(rng)} if rng.random() < 0.5 else {}
    return {**{k: v for k, v in base.items() if k not in dropped}, **changes, **extra}


def _fuzz(draw: Callable[[random.Random], Any], check: Callable[[Any], None]) -> None:
    first = random.SystemRandom().randrange(2**48)
    for seed in range(first, first + EXAMPLES):
        example = draw(random.Random(seed))
        try:
            check(example)
        except Exception as exc:
            raise AssertionError(f"seed {seed}: {example!r}: {exc!r}") from exc


def _encodable(data: object) -> None:
    msgpack.packb(data, use_bin_type=True)  # raises if anything is out of msgpack's range


# -- announcements --------------------------------------------------------------------

PEER = "12D3KooWpeer"
DEVICE = DeviceProfile(
    peer_id=PEER,
    device="cpu",
    backend="cpu",
    name="x86",
    memory_total_bytes=8 << 30,
    memory_free_bytes=4 << 30,
    matmul_flops=1e11,
    memory_bandwidth_bps=2e10,
)
RECORD = Announcement(
    version="0.1.0",
    peer_id=PEER,
    boot_id=1,
    seq=2,
    addrs=("/ip4/10.0.0.2/tcp/4001",),
    devices=(DEVICE,),
    links=(LinkProfile(src=PEER, dst="other", rtt_s=1e-4, bandwidth_bps=1e9),),
    stages=(ServedStage(model="m", start=0, end=4, ready=True).to_wire(),),
    load=Load(queue_depth=1, recent_step_s=(0.01,)),
    known_peers=(KnownPeer(peer_id="other", addrs=("/ip4/10.0.0.3/tcp/4001",)),),
    extra=serving_extra(
        ServingAnnouncement(
            model="m",
            calibration=Calibration(model="m", device="cpu", block_step_s=0.002, context_tokens=8),
        )
    ),
).to_wire()


def _record_with_parts(rng: random.Random) -> dict[str, Any]:
    """A record whose top level, or one device, link or load entry, is mutated."""
    part = rng.randrange(4)
    if part == 0:
        return _mutated(rng, RECORD)
    if part == 1:
        return {**RECORD, "devices": [_mutated(rng, RECORD["devices"][0])]}
    if part == 2:
        return {**RECORD, "links": [_mutated(rng, RECORD["links"][0])]}
    return {**RECORD, "load": _mutated(rng, RECORD["load"])}


def test_announcements_parse_sane_or_raise_protocol_error() -> None:
    _fuzz(_record_with_parts, _check_announcement)


def _check_announcement(data: dict[str, Any]) -> None:
    try:
        payload = msgpack.packb(data, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return  # not sendable: no peer can put it on the wire
    try:
        record = wire.decode_announcement(payload)
    except RemoteProtocolError:
        return
    assert all(d.peer_id == record.peer_id for d in record.devices)
    assert all(link.src == record.peer_id for link in record.links)
    numbers = [record.sent_at_s, *record.load.recent_step_s]
    numbers += [x for d in record.devices for x in (d.matmul_flops, d.memory_bandwidth_bps)]
    numbers += [x for link in record.links for x in (link.rtt_s, link.bandwidth_bps)]
    assert all(math.isfinite(x) for x in numbers)
    _encodable(record.to_wire())  # what we relay (peer exchange, status) encodes again


def _serving_inputs(rng: random.Random) -> tuple[dict[str, Any], list[Any]]:
    stage = RECORD["stages"][0]
    stages = [
        hostile(rng) if rng.random() < 0.5 else _mutated(rng, stage)
        for _ in range(rng.randint(0, 4))
    ]
    return _mutated(rng, RECORD["extra"]), stages


def test_serving_state_always_reads() -> None:
    _fuzz(_serving_inputs, lambda inputs: _check_serving(*inputs))


def _check_serving(extra: dict[str, Any], stages: list[Any]) -> None:
    state = read_serving(extra, stages)
    for stage in state.stages:
        assert isinstance(stage.start, int)
        assert isinstance(stage.end, int)
        assert 0 <= stage.start < stage.end
    if state.calibration is not None:
        assert math.isfinite(state.calibration.block_step_s)
    assert all(math.isfinite(v) for v in state.gateway.values())
    serving_stages(state)  # what a reader re-announces is well formed
    serving_extra(state)


# -- the generate request: the libp2p RPC's map and the HTTP body -----------------------

REQUEST = GenerateRequest(
    prompt_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=4, temperature=0.7, seed=5)
).to_wire()
BODY = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 4,
    "temperature": 0.5,
    "top_p": 0.9,
    "seed": 1,
    "stop": ["."],
    "stream": False,
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _request(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.5:
        return _mutated(rng, REQUEST)
    return {_text(rng, 8): hostile(rng) for _ in range(rng.randint(0, 6))}


def test_generate_requests_parse_encodable_or_are_invalid() -> None:
    _fuzz(_request, _check_request)


def _check_request(data: dict[str, Any]) -> None:
    try:
        request = GenerateRequest.from_wire(data)
    except InvalidRequest:
        return
    _encodable(request.to_wire())  # the gateway sends its sampling on to the stages
    assert GenerateRequest.from_wire(request.to_wire()) == request


def _body(rng: random.Random) -> Any:
    kind = rng.randrange(3)
    return hostile(rng) if kind == 0 else _mutated(rng, BODY if kind == 1 else CHAT)


def test_http_bodies_parse_encodable_or_are_4xx() -> None:
    _fuzz(_body, _check_body)


def _check_body(body: Any) -> None:
    try:
        parsed = parse_api_request(body, chat="messages" in str(body)[:200], models=["m"])
    except ApiError as err:
        status = err.status
    except InvalidRequest:
        return  # answered 400 by the API's error mapping
    else:
        _encodable(parsed.request.to_wire())
        return
    assert 400 <= status < 500


# -- session control --------------------------------------------------------------------

OPEN = OpenSession(
    session_id="s",
    start=0,
    end=4,
    next_peer="b",
    gateway="g",
    max_tokens=16,
    sampling=SamplingParams(seed=3),
).to_wire()


CLOSE = CloseSession(session_id="s").to_wire()
REPLY = Reply(ok=False, kind="Rejected", message="busy").to_wire()


def _control(rng: random.Random) -> dict[str, Any]:
    kind = rng.randrange(4)
    if kind == 1:
        return {**OPEN, "sampling": _mutated(rng, OPEN["sampling"])}
    return _mutated(rng, (OPEN, None, CLOSE, REPLY)[kind])


def test_control_payloads_parse_or_raise_protocol_error() -> None:
    _fuzz(_control, _check_control)


def _sendable(data: object) -> bool:
    """Whether msgpack can carry ``data`` at all (no integer beyond 64 bits, say)."""
    try:
        msgpack.packb(data, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return False
    return True


def _check_control(data: dict[str, Any]) -> None:
    if not _sendable(data):
        return  # no peer can put it on the wire: the RPC's map arrives through msgpack
    if "ok" in data and "op" not in data:
        try:
            reply = Reply.from_wire(data)
        except ValueError:
            return  # the caller's RemoteProtocolError
        error = reply.error()
        assert error is None or isinstance(error, Exception)
        return
    try:
        request = parse_request(data)
    except RemoteProtocolError:
        return
    if isinstance(request, OpenSession):
        _encodable(request.to_wire())


def test_the_drawers_draw_hostile_values_of_every_kind() -> None:
    rng = random.Random(3)
    values = [hostile(rng) for _ in range(2000)]
    kinds = {type(v) for v in values}
    assert {type(None), bool, int, float, str, bytes, list, dict} <= kinds
    assert any(isinstance(v, int) and not -(2**64) <= v < 2**64 for v in values)
    assert any(isinstance(v, float) and math.isnan(v) for v in values)
