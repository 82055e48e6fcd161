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
again. Its share of the fuzz budget: a quarter of ``HETMESH_FUZZ_EXAMPLES``
(10,000 by default, what each byte-level fuzz test runs alone), so 2,500
examples split evenly among its tests, a few seconds in all (the
generation of nested maps, not the decoders, is what costs).
"""

from __future__ import annotations

import math
import os
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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

_TESTS = 5
TOTAL = int(os.environ.get("HETMESH_FUZZ_EXAMPLES", "10000")) // 4
SHARE = settings(
    max_examples=max(1, TOTAL // _TESTS),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# values a hostile peer can put in any msgpack/JSON slot
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**63, 2**64, 2**64 - 1, -(2**63) - 1, 0, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, 5e-324, 1e-45]),
    st.text(max_size=12),
    st.binary(max_size=12),
)
hostile = st.recursive(
    _scalar,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` with some of its keys given hostile values, some dropped, one added."""
    keys = sorted(base)
    return st.builds(
        lambda changes, dropped, extra: {
            **{k: v for k, v in base.items() if k not in dropped},
            **changes,
            **extra,
        },
        st.dictionaries(st.sampled_from(keys), hostile, max_size=3),
        st.sets(st.sampled_from(keys), max_size=2),
        st.dictionaries(st.text(max_size=6), hostile, max_size=1),
    )


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


def _record_with_parts() -> st.SearchStrategy[dict[str, Any]]:
    """A record whose top level, or one device, link or load entry, is mutated."""
    device, link = RECORD["devices"][0], RECORD["links"][0]
    return st.one_of(
        _mutated(RECORD),
        _mutated(device).map(lambda d: {**RECORD, "devices": [d]}),
        _mutated(link).map(lambda x: {**RECORD, "links": [x]}),
        _mutated(RECORD["load"]).map(lambda x: {**RECORD, "load": x}),
    )


@SHARE
@given(_record_with_parts())
def test_announcements_parse_sane_or_raise_protocol_error(data: dict[str, Any]) -> None:
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


@SHARE
@given(
    _mutated(RECORD["extra"]),
    st.lists(st.one_of(hostile, _mutated(RECORD["stages"][0])), max_size=4),
)
def test_serving_state_always_reads(extra: dict[str, Any], stages: list[Any]) -> None:
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


@SHARE
@given(st.one_of(_mutated(REQUEST), st.dictionaries(st.text(max_size=8), hostile, max_size=6)))
def test_generate_requests_parse_encodable_or_are_invalid(data: dict[str, Any]) -> None:
    try:
        request = GenerateRequest.from_wire(data)
    except InvalidRequest:
        return
    _encodable(request.to_wire())  # the gateway sends its sampling on to the stages
    assert GenerateRequest.from_wire(request.to_wire()) == request


@SHARE
@given(st.one_of(_mutated(BODY), _mutated(CHAT), hostile))
def test_http_bodies_parse_encodable_or_are_4xx(body: Any) -> None:
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


@SHARE
@given(
    st.one_of(
        _mutated(OPEN),
        _mutated(OPEN["sampling"]).map(lambda s: {**OPEN, "sampling": s}),
        _mutated(CloseSession(session_id="s").to_wire()),
        _mutated(Reply(ok=False, kind="Rejected", message="busy").to_wire()),
    )
)
def test_control_payloads_parse_or_raise_protocol_error(data: dict[str, Any]) -> None:
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


def test_the_split_reaches_the_suites_share() -> None:
    assert SHARE.max_examples * _TESTS >= TOTAL - _TESTS
    assert sum(1 for name in globals() if name.startswith("test_")) - 1 == _TESTS


pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
