"""The one generate request/reply record: validation, defaults, wire maps, finish reason."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from hetmesh.errors import InvalidRequest, NoRoute, Rejected, RemoteProtocolError
from hetmesh.protocol.generate import (
    DEFAULT_MAX_NEW_TOKENS,
    Delta,
    Finish,
    GenerateRequest,
    SamplingParams,
    check_messages,
    error_reply,
    finish_reason,
    reply_from_wire,
)


def test_defaults_are_the_documented_ones() -> None:
    params = SamplingParams()
    assert params.max_new_tokens == DEFAULT_MAX_NEW_TOKENS == 128
    assert params.greedy
    assert (params.top_k, params.top_p, params.seed, params.stop) == (None, None, None, ())


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_new_tokens": 2**64}, "max_new_tokens"),  # found by the fuzz suite
        ({"top_k": 2**64}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"temperature": 1e-45}, "temperature"),  # divides logits into inf
        ({"temperature": 1e300}, "temperature"),
        ({"stop": ("",)}, "stop"),
        ({"stop": (3,)}, "stop"),
    ],
)
def test_one_validation_names_the_bad_field(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == param


def test_a_request_map_round_trips_and_unset_values_stay_off_the_wire() -> None:
    params = SamplingParams.of(max_new_tokens=5, temperature=0.5, stop="\n", seed=None)
    request = GenerateRequest(prompt="Hi", chat=True, sampling=params)
    wire = request.to_wire()
    assert wire == {
        "prompt": "Hi",
        "chat": True,
        "max_new_tokens": 5,
        "temperature": 0.5,
        "stop": ["\n"],
    }
    assert GenerateRequest.from_wire(wire) == request
    assert GenerateRequest.from_wire({"prompt_ids": [1, 2]}).sampling == SamplingParams()


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"prompt": ""},
        {"prompt": 5},
        {"prompt_ids": "12"},
        {"prompt_ids": [1, True]},
        {"messages": []},
        {"messages": "hello"},
        {"prompt": "x", "max_new_tokens": "many"},
        {"prompt": "x", "top_p": 2},
        {"prompt": "x", "nonsense": 1, "stop": [""]},
    ],
)
def test_malformed_request_maps_are_invalid_requests(data: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        GenerateRequest.from_wire(data)


def test_unknown_request_keys_are_ignored() -> None:
    assert GenerateRequest.from_wire({"prompt": "x", "future": 1}).prompt == "x"


def test_sampling_travels_in_session_control_as_a_wire_record() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11)
    assert SamplingParams.from_wire(params.to_wire()) == params
    assert SamplingParams.from_wire({}) == SamplingParams()
    with pytest.raises(ValueError, match="top_k"):  # the WireRecord contract
        SamplingParams.from_wire({"top_k": -1})
    with pytest.raises(ValueError, match="map"):
        SamplingParams.from_wire([1])
    assert dataclasses.replace(params, seed=3).seed == 3


@pytest.mark.parametrize(
    ("tokens", "limit", "reason"),
    [(0, 1, "stop"), (3, 4, "stop"), (4, 4, "length"), (5, 4, "length")],
)
def test_finish_reason(tokens: int, limit: int, reason: str) -> None:
    assert finish_reason(tokens, limit) == reason


def test_replies_round_trip_and_errors_raise_their_class() -> None:
    for event in (Delta(" a", 42), Delta("!", None), Finish("length", 3, 2)):
        assert reply_from_wire(event.to_wire()) == event
    with pytest.raises(Rejected, match="busy"):
        reply_from_wire(error_reply(Rejected("busy")))
    with pytest.raises(NoRoute):
        reply_from_wire(error_reply(NoRoute("gone")))
    with pytest.raises(RemoteProtocolError):
        reply_from_wire({"token": "x"})
    with pytest.raises(RemoteProtocolError):
        reply_from_wire({"done": True, "prompt_tokens": "many"})


def test_the_shared_records_and_codecs_are_pure() -> None:
    """Client and node both import them: they must pull in no trio, libp2p or torch."""
    code = (
        "import sys\n"
        "import hetmesh.protocol.generate, hetmesh.error_codec, hetmesh.node.readiness\n"
        "print(sorted(m for m in ('trio', 'libp2p', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_conversation_is_checked_once_for_every_surface() -> None:
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert check_messages(turns) == tuple(turns)
    request = GenerateRequest.from_wire({"messages": turns, "chat": True})
    assert request.messages == tuple(turns)
    for bad, what in (
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user", "content": 3}], "content"),
        (["hello"], "content"),
        ([], "non-empty"),
    ):
        with pytest.raises(InvalidRequest, match=what):
            GenerateRequest.from_wire({"messages": bad})


def test_bounds_admit_their_extremes_and_refuse_one_past() -> None:
    from hetmesh.protocol.generate import MAX_SEED, MAX_TOKEN_ID, MIN_TEMPERATURE

    assert SamplingParams(seed=MAX_SEED, temperature=MIN_TEMPERATURE).seed == 2**64 - 1
    assert GenerateRequest(prompt_ids=(0, MAX_TOKEN_ID)).prompt_ids[-1] == MAX_TOKEN_ID
    for ids in [(MAX_TOKEN_ID + 1,), (2**63,), (-1,)]:
        with pytest.raises(InvalidRequest) as caught:
            GenerateRequest(prompt_ids=ids)
        assert caught.value.param == "prompt_ids"
    with pytest.raises(InvalidRequest):
        GenerateRequest.from_wire({"prompt_ids": [2**64]})
