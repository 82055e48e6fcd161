"""Log-probabilities and n choices: the codec, the sampler, the Tokens frame, the API's shapes.

The API parts run on the real ASGI stack against the unit tests' fake mesh
(tests/unit/node/test_api.py); the real mesh is tested in
tests/integration/api/test_api_structured.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator, Sequence

import httpx
import pytest
import torch
import trio
import trio.lowlevel

from hetmesh.errors import InvalidRequest, RemoteProtocolError
from hetmesh.node.api_choices import choice_params
from hetmesh.partition.sampling import Sampler, token_logprobs
from hetmesh.protocol.generate import SamplingParams
from hetmesh.protocol.logprobs import Sampled, TokenLogprobs, pack, token_of, unpack, wire_of
from hetmesh.transport.frames import Tokens, decode_all, encode_bytes
from tests.unit.node.test_api import MODEL, FakeBackend


def test_the_codec_round_trips_and_refuses_bad_bytes() -> None:
    info = TokenLogprobs(-0.5, ((7, -0.5), (3, -1.25)))
    assert unpack(pack(info)) == info
    assert unpack(pack(TokenLogprobs(-2.0))) == TokenLogprobs(-2.0)
    with pytest.raises(RemoteProtocolError):
        unpack(b"\x00\x00")
    with pytest.raises(RemoteProtocolError):
        unpack(pack(info) + b"\x00")
    token = token_of(7, pack(info))
    assert token == 7
    assert isinstance(token, Sampled)
    assert token.logprobs == info
    assert wire_of(token) == pack(info)
    assert wire_of(7) == b""
    assert type(token_of(7, b"")) is int


def test_the_tokens_frame_carries_them() -> None:
    info = pack(TokenLogprobs(-0.25, ((1, -0.25),)))
    frame = Tokens(session_id="s", step=3, token_ids=(9,), position=5, logprobs=info)
    (back,) = decode_all(encode_bytes(frame))
    assert isinstance(back, Tokens)
    assert (back.token_ids, back.position, back.logprobs) == ((9,), 5, info)
    (plain,) = decode_all(encode_bytes(Tokens(session_id="s", step=1, token_ids=(2,))))
    assert isinstance(plain, Tokens)
    assert plain.logprobs == b""


def test_the_sampler_reports_the_models_own_log_probabilities() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    expected = torch.log_softmax(logits, dim=-1)
    token = Sampler(SamplingParams(logprobs=2))(logits, 0)
    assert token == 1
    assert isinstance(token, Sampled)
    assert token.logprobs.logprob == pytest.approx(float(expected[1]))
    assert [i for i, _ in token.logprobs.top] == [1, 2]
    assert token.logprobs.top[1][1] == pytest.approx(float(expected[2]))
    # sampled: the drawn token's own log-probability, before temperature
    drawn = Sampler(SamplingParams(logprobs=0, temperature=0.7, seed=3))(logits, 0)
    assert isinstance(drawn, Sampled)
    assert drawn.logprobs.top == ()
    assert drawn.logprobs.logprob == pytest.approx(float(expected[int(drawn)]))
    # none asked: a plain int, the same draw
    plain = Sampler(SamplingParams(temperature=0.7, seed=3))(logits, 0)
    assert type(plain) is int
    assert plain == int(drawn)
    assert math.isclose(sum(math.exp(lp) for lp in expected.tolist()), 1.0, rel_tol=1e-5)
    assert token_logprobs(logits, 0, 4).top[0][0] == 1
    with pytest.raises(InvalidRequest):
        SamplingParams(logprobs=21)


def test_each_seeded_choice_draws_its_own_seed() -> None:
    params = SamplingParams(temperature=1.0, seed=2**64 - 1)
    assert [p.seed for p in choice_params(params, 3)] == [2**64 - 1, 0, 1]
    assert choice_params(SamplingParams(), 2) == [SamplingParams()] * 2


class LogprobsBackend(FakeBackend):
    """Tokens carry log-probabilities (-0.1 * i, and one alternative) when asked;
    each stream records its sampling."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[SamplingParams] = []

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]:
        self.asked.append(params)
        for i in range(params.max_new_tokens):
            await trio.lowlevel.checkpoint()
            token: int = 100 + i
            if params.logprobs is not None:
                top = ((100 + i, -0.1 * i), (200, -3.0))[: params.logprobs]
                token = Sampled(token, TokenLogprobs(-0.1 * i, top))
            yield token, f" t{i}"

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return [f" t{i - 100}" if i < 200 else "<alt>" for i in ids]


async def test_chat_logprobs_in_openais_shape(
    api: tuple[httpx.AsyncClient, LogprobsBackend],
) -> None:
    http, backend = api
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    choice = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [" t0", " t1", " t2"]
    assert [c["logprob"] for c in content] == pytest.approx([0.0, -0.1, -0.2])
    assert content[1]["bytes"] == list(b" t1")
    assert [t["token"] for t in content[1]["top_logprobs"]] == [" t1", "<alt>"]
    assert backend.asked[-1].logprobs == 2
    # streamed: each chunk its token's entry
    body |= {"stream": True, "top_logprobs": 0}
    entries = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    entries += (c.get("logprobs") or {}).get("content") or []
    assert [(e["token"], e["top_logprobs"]) for e in entries] == [
        (" t0", []),
        (" t1", []),
        (" t2", []),
    ]
    # not asked: none, and the stage is not asked either
    plain = {"model": MODEL, "messages": body["messages"], "max_tokens": 2}
    choice = (await http.post("/v1/chat/completions", json=plain)).json()["choices"][0]
    assert choice["logprobs"] is None
    assert backend.asked[-1].logprobs is None


async def test_completion_logprobs_in_the_legacy_shape(
    api: tuple[httpx.AsyncClient, LogprobsBackend],
) -> None:
    http, _ = api
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 1}
    logprobs = (await http.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
    assert logprobs == {
        "tokens": [" t0", " t1"],
        "token_logprobs": pytest.approx([0.0, -0.1]),
        "top_logprobs": [{" t0": 0.0}, {" t1": pytest.approx(-0.1)}],
        "text_offset": [0, 3],
    }


async def test_n_choices_run_one_session_each(
    api: tuple[httpx.AsyncClient, LogprobsBackend],
) -> None:
    http, backend = api
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 3, "seed": 5, "temperature": 1}
    reply = (await http.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert all(c["text"] == " t0 t1" for c in reply["choices"])
    assert reply["usage"]["completion_tokens"] == 6
    assert sorted(p.seed for p in backend.asked[-3:]) == [5, 6, 7]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage: dict[str, int] = {}
    async with http.stream("POST", "/v1/completions", json=body) as reply_stream:
        async for line in reply_stream.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    reasons[c["index"]] = c["finish_reason"]
            usage = chunk.get("usage") or usage
    assert texts == {0: " t0 t1", 1: " t0 t1", 2: " t0 t1"}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert usage["completion_tokens"] == 6


@pytest.mark.parametrize(
    ("chat", "extra", "param"),
    [
        (True, {"top_logprobs": 2}, "top_logprobs"),
        (True, {"logprobs": 3}, "logprobs"),
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (False, {"logprobs": True}, "logprobs"),
        (False, {"logprobs": 21}, "logprobs"),
        (False, {"n": 0}, "n"),
        (False, {"echo": True}, "echo"),
        (False, {"best_of": 2}, "best_of"),
        (True, {"presence_penalty": 0.5}, "presence_penalty"),
        (True, {"functions": []}, "functions"),
        (True, {"audio": {}}, "audio"),
        (False, {"messages": []}, "messages"),
    ],
)
async def test_unsupported_or_bad_fields_are_refused_by_name(
    api: tuple[httpx.AsyncClient, LogprobsBackend], chat: bool, extra: dict[str, object], param: str
) -> None:
    http, _ = api
    base: dict[str, object] = {"model": MODEL, "max_tokens": 2}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    route = "/v1/chat/completions" if chat else "/v1/completions"
    reply = await http.post(route, json=base | extra)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    # the neutral values and bookkeeping fields pass
    neutral = {"presence_penalty": 0, "user": "me", "logit_bias": {}, "store": False}
    assert (await http.post(route, json=base | neutral)).status_code == 200
