"""The SDK's pure half: options, timeouts, request building, reply decoding, exports."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hetmesh
from hetmesh.client._base import (
    Delta,
    Finish,
    SamplingOptions,
    Timeout,
    chat_messages,
    collect,
    decode_reply,
    decode_sse_chunk,
    generate_request,
    http_error,
)
from hetmesh.error_codec import error_from_wire
from hetmesh.errors import (
    InvalidRequest,
    MeshError,
    NoRoute,
    Rejected,
    RemoteProtocolError,
    RequestTimeout,
)


def test_hetmesh_all_is_pinned() -> None:
    assert hetmesh.__all__ == [
        "AsyncClient",
        "Client",
        "ClientError",
        "Completion",
        "ConnectTimeout",
        "Delta",
        "InvalidRequest",
        "MeshError",
        "NoRoute",
        "PeerUnreachable",
        "Rejected",
        "RequestTimeout",
        "SamplingOptions",
        "Timeout",
        "__version__",
        "errors",
    ]
    for name in hetmesh.__all__:
        assert getattr(hetmesh, name) is not None


def test_importing_hetmesh_loads_no_trio_until_a_client_is_asked_for() -> None:
    code = (
        "import sys, hetmesh\n"
        "print('trio' in sys.modules, end=' ')\n"
        "hetmesh.Client\n"
        "print('trio' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False True"


@pytest.mark.parametrize(
    "kwargs",
    [{"connect": 0}, {"first_token": -1}, {"total": float("nan")}, {"connect": True}],
)
def test_timeout_rejects_non_positive_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidRequest):
        Timeout(**kwargs)


def test_timeout_none_means_no_limit() -> None:
    assert Timeout(connect=None, first_token=None, total=None).total is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"max_new_tokens": -3},
        {"max_new_tokens": True},
        {"temperature": -0.5},
        {"temperature": float("inf")},
        {"top_k": 0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": 1.5},
        {"stop": ("",)},
        {"colour": "blue"},
    ],
)
def test_sampling_options_reject_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest):
        SamplingOptions.of(**kwargs)


def test_sampling_options_to_wire_and_openai() -> None:
    options = SamplingOptions.of(max_new_tokens=5, temperature=0.7, seed=3, stop="\n", top_k=None)
    assert options.stop == ("\n",)
    assert options.to_wire() == {"max_new_tokens": 5, "temperature": 0.7, "seed": 3, "stop": ["\n"]}
    assert options.to_openai() == {"max_tokens": 5, "temperature": 0.7, "seed": 3, "stop": ["\n"]}


def test_generate_request_carries_prompts_and_conversations() -> None:
    options = SamplingOptions(max_new_tokens=4)
    assert generate_request("Hi", options, chat=True) == {
        "prompt": "Hi",
        "max_new_tokens": 4,
        "chat": True,
    }
    with pytest.raises(InvalidRequest):
        generate_request("   ", options)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert generate_request(turns, options, chat=True) == {"messages": turns, "max_new_tokens": 4}
    assert chat_messages(turns) == turns
    with pytest.raises(InvalidRequest):
        chat_messages([])
    with pytest.raises(InvalidRequest, match="role"):
        chat_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(InvalidRequest, match="content"):
        chat_messages([{"role": "user", "content": 3}])


def test_decode_reply_tokens_flush_finish_and_errors() -> None:
    assert decode_reply({"token": 42, "text": " a"}) == Delta(" a", 42)
    assert decode_reply({"token": -1, "text": "!"}) == Delta("!", None)
    assert decode_reply(
        {"done": True, "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2}
    ) == Finish("length", 3, 2)
    with pytest.raises(Rejected, match="busy"):
        decode_reply({"error": "Rejected", "message": "busy"})
    with pytest.raises(RemoteProtocolError):
        decode_reply({"tok": 1})
    with pytest.raises(RemoteProtocolError):
        decode_reply({"token": 1, "text": 7})


def test_error_from_wire_falls_back_to_mesh_error_for_unknown_names() -> None:
    err = error_from_wire("NotAnError", "boom")
    assert type(err) is MeshError
    assert "NotAnError" in str(err)
    assert isinstance(error_from_wire("InsufficientCapacity", "x"), MeshError)


def test_collect_joins_text_and_ids_and_needs_a_finish() -> None:
    deltas = [Delta("Hel", 1), Delta("lo", 2), Delta("!", None)]
    done = collect(deltas, Finish("stop", 4, 2))
    assert done.text == "Hello!"
    assert done.token_ids == (1, 2)
    assert done.finish_reason == "stop"
    with pytest.raises(RemoteProtocolError):
        collect(deltas, None)


def test_decode_sse_chunks_of_completions_and_chats() -> None:
    text = {"choices": [{"index": 0, "text": " hi", "token_ids": [5], "finish_reason": None}]}
    assert decode_sse_chunk(text) == [Delta(" hi", 5)]
    chat = {"choices": [{"delta": {"content": "yo"}, "token_ids": [6], "finish_reason": None}]}
    assert decode_sse_chunk(chat) == [Delta("yo", 6)]
    end = {"choices": [{"delta": {}, "token_ids": [], "finish_reason": "stop"}]}
    assert decode_sse_chunk(end) == [Finish("stop", -1, -1)]
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    assert decode_sse_chunk(usage) == [Finish("", 3, 2)]
    with pytest.raises(Rejected):
        decode_sse_chunk({"error": {"message": "busy", "hetmesh_error": "Rejected"}})


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (400, {"error": {"message": "bad"}}, InvalidRequest),
        (429, {"error": {"message": "busy"}}, Rejected),
        (503, None, NoRoute),
        (504, "x", RequestTimeout),
        (500, {"error": {"message": "?", "hetmesh_error": "NoRoute"}}, NoRoute),
        (418, None, MeshError),
    ],
)
def test_http_error_maps_statuses_and_names(status: int, body: object, kind: type) -> None:
    assert type(http_error(status, body)) is kind
