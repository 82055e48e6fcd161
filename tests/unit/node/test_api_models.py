"""Several models behind one API (issue 49, item 1): ``ModelsBackend`` routes a request
by its ``model``; ``memory_shares`` splits a node's memory among its models."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

import httpx
import pytest
import trio

from hetmesh.errors import InvalidRequest
from hetmesh.node.api_serve import serve_http
from hetmesh.node.backend import ModelsBackend
from hetmesh.node.models import check_min_replicas, member_config, memory_shares, model_slug
from hetmesh.node.runtime import NodeConfig
from hetmesh.protocol.generate import SamplingParams
from tests.unit.node.test_api import FakeBackend


class Named(FakeBackend):
    """A fake member serving ``name``, whose tokens spell it."""

    def __init__(self, name: str, context: int) -> None:
        super().__init__()
        self.name = name
        self.context = context
        self.prompts: list[list[int]] = []

    def models(self) -> list[str]:
        return [self.name]

    def max_context(self) -> int:
        return self.context

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]:
        self.prompts.append(list(prompt_ids))
        for i in range(params.max_new_tokens):
            yield 100 + i, f" {self.name}{i}"


async def test_requests_route_by_model_and_models_lists_every_member(
    nursery: trio.Nursery,
) -> None:
    members: dict[str, Any] = {"big": Named("big", 64), "small": Named("small", 16)}
    backend = ModelsBackend(lambda: members)
    url = await nursery.start(lambda task_status: serve_http(backend, task_status=task_status))
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        listed = (await http.get("/v1/models")).json()
        assert [m["id"] for m in listed["data"]] == ["big", "small"]
        for name in ("big", "small"):
            body = {"model": name, "prompt": "one two", "max_tokens": 3}
            reply = (await http.post("/v1/completions", json=body)).json()
            assert reply["model"] == name
            assert reply["choices"][0]["text"] == f" {name}0 {name}1 {name}2"
        assert len(members["big"].prompts) == len(members["small"].prompts) == 1
        # each model's own context bounds its requests
        long = {"model": "small", "prompt": "one two", "max_tokens": 20}
        refused = await http.post("/v1/completions", json=long)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        assert (await http.post("/v1/completions", json={**long, "model": "big"})).is_success
        # an unknown model is a 404 naming the models served, as OpenAI's is
        missing = await http.post("/v1/completions", json={**long, "model": "gpt-4"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        assert "big, small" in missing.json()["error"]["message"]
        # a model removed is no longer listed nor served; the other still is
        del members["small"]
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["big"]
        gone = await http.post("/v1/completions", json={**long, "model": "small"})
        assert gone.status_code == 404
        assert (await http.post("/v1/completions", json={**long, "model": "big"})).is_success


def test_memory_is_split_by_the_given_shares_and_evenly_otherwise() -> None:
    gib = 1 << 30
    assert memory_shares(4 * gib, ["a", "b"], {}) == {"a": 2 * gib, "b": 2 * gib}
    assert memory_shares(4 * gib, ["a", "b", "c"], {"a": 2 * gib}) == {
        "a": 2 * gib,
        "b": gib,
        "c": gib,
    }
    with pytest.raises(InvalidRequest, match="not a --model"):
        memory_shares(4 * gib, ["a"], {"z": gib})
    with pytest.raises(InvalidRequest, match="named twice"):
        memory_shares(4 * gib, ["a", "a"], {})
    with pytest.raises(InvalidRequest, match="less than"):
        memory_shares(4 * gib, ["a", "b"], {"a": 4 * gib})


def test_each_member_has_its_own_directory_memory_and_port(tmp_path: Any) -> None:
    config = NodeConfig(
        listen=("/ip4/0.0.0.0/tcp/4001",),
        bootstrap=("/ip4/10.0.0.2/tcp/1/p2p/X",),
        data_dir=tmp_path,
        api_port=8000,
    )
    first = member_config(config, "smollm2", 1 << 30, None)
    assert first.listen == config.listen
    assert first.bootstrap == config.bootstrap
    assert first.api_port is None
    assert first.max_memory_bytes == 1 << 30
    assert first.serving is not None
    assert first.serving.model == "smollm2"
    second = member_config(config, "/models/My Model", 1 << 29, "/ip4/1.2.3.4/tcp/4001/p2p/A")
    assert second.listen == ("/ip4/0.0.0.0/tcp/0",)
    assert second.bootstrap == ("/ip4/1.2.3.4/tcp/4001/p2p/A", *config.bootstrap)
    assert second.data_dir == tmp_path / "models" / model_slug("/models/My Model")
    assert second.data_dir != first.data_dir
    assert "/" not in model_slug("/models/My Model")


def test_the_cli_starts_one_member_per_repeated_model(monkeypatch: Any, tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from hetmesh.cli import app

    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr("hetmesh.cli.node.trio.run", lambda func, *args: seen.append(args))
    args = ["node", "start", "--data-dir", str(tmp_path), "--max-memory", "4GiB"]
    models = ["--model", "smollm2-135m-instruct", "--model", "synth-tiny"]
    given = ["--model-memory", "synth-tiny=1GiB", "--min-replicas", "synth-tiny=2"]
    result = CliRunner().invoke(app, [*args, *models, *given])
    assert result.exit_code == 0, result.output
    (config, names, memory, replicas), *_ = seen
    assert names == ["smollm2-135m-instruct", "synth-tiny"]
    assert memory == {"synth-tiny": 1 << 30}
    assert replicas == {"synth-tiny": 2}
    assert config.max_memory_bytes == 4 << 30
    # one model: the single-model node, as before
    result = CliRunner().invoke(app, [*args, "--model", "synth-tiny"])
    assert result.exit_code == 0, result.output
    assert len(seen[1]) == 1
    assert seen[1][0].serving.model == "synth-tiny"
    # a config file may name several models as a list
    f = tmp_path / "node.toml"
    f.write_text('model = ["a", "b"]\nmodel-memory = ["a=1GiB"]\nmin-replicas = ["b=2"]\n')
    result = CliRunner().invoke(app, ["node", "start", "--config", str(f)])
    assert result.exit_code == 0, result.output
    assert seen[2][1:] == (["a", "b"], {"a": 1 << 30}, {"b": 2})
    bad = CliRunner().invoke(app, [*args, *models, "--model-memory", "synth-tiny"])
    assert bad.exit_code != 0
    assert "NAME=SIZE" in str(bad.exception or bad.output)


def test_the_gauges_of_several_members_add_up() -> None:
    from hetmesh.node.api_metrics import MeshGauges

    class Gauged(Named):
        def __init__(self, name: str, gauges: MeshGauges) -> None:
            super().__init__(name, 64)
            self._gauges = gauges

        def gauges(self) -> MeshGauges:
            return self._gauges

    kv = {"kv_blocks_in_use": 2.0}
    big = MeshGauges(
        ready=True, plan_epoch=4, tokens_out=10, active_sessions=1, stages_kv=(("0-30", kv),)
    )
    small = MeshGauges(
        ready=False, plan_epoch=9, tokens_out=5, active_sessions=2, stages_kv=(("0-4", kv),)
    )
    members: dict[str, Any] = {"big": Gauged("big", big), "small": Gauged("small", small)}
    gauges = ModelsBackend(lambda: members).gauges()
    assert gauges.tokens_out == 15
    assert gauges.active_sessions == 3
    assert gauges.ready is False  # one model has no ready pipeline
    assert gauges.plan_epoch == 4
    assert [u for u, _ in gauges.stages_kv] == ["big:0-30", "small:0-4"]
    assert ModelsBackend(dict).gauges() == MeshGauges()


class Control:
    """Adds and removes the ``Named`` members of a ``ModelsBackend``'s mapping."""

    def __init__(self, members: dict[str, Any]) -> None:
        self.members = members
        self.added: list[tuple[str, int]] = []

    async def add_model(self, model: str, memory_bytes: int) -> str:
        from hetmesh.errors import ModelNotFound

        if model == "missing":
            raise ModelNotFound("no such model: missing")
        self.added.append((model, memory_bytes))
        self.members[model] = Named(model, 32)
        return model

    async def remove_model(self, key: str) -> None:
        from hetmesh.errors import ModelNotFound

        if self.members.pop(key, None) is None:
            raise ModelNotFound(f"this node does not serve {key!r}")


async def test_models_are_added_and_removed_over_the_api(nursery: trio.Nursery) -> None:
    members: dict[str, Any] = {"big": Named("big", 64)}
    control = Control(members)
    backend = ModelsBackend(lambda: members)
    url = await nursery.start(
        lambda task_status: serve_http(backend, models=control, task_status=task_status)
    )
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        added = await http.post(
            "/v1/hetmesh/models", json={"model": "synth-tiny", "memory_bytes": 1 << 30}
        )
        assert added.status_code == 201, added.text
        assert added.json()["id"] == "synth-tiny"
        assert control.added == [("synth-tiny", 1 << 30)]
        listed = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        assert listed == ["big", "synth-tiny"]
        body = {"model": "synth-tiny", "prompt": "a", "max_tokens": 2}
        reply = (await http.post("/v1/completions", json=body)).json()
        assert reply["choices"][0]["text"] == " synth-tiny0 synth-tiny1"
        # names only: never a path on the node; a memory of some size
        for bad, param in (
            ({"model": "/etc/passwd", "memory_bytes": 1 << 30}, "model"),
            ({"model": "../models/x", "memory_bytes": 1 << 30}, "model"),
            ({"model": "x.gguf", "memory_bytes": 1 << 30}, "model"),
            ({"model": "synth-tiny", "memory_bytes": 10}, "memory_bytes"),
            ({"model": "synth-tiny", "memory_bytes": "1GiB"}, "memory_bytes"),
        ):
            refused = await http.post("/v1/hetmesh/models", json=bad)
            assert refused.status_code == 400, bad
            assert refused.json()["error"]["param"] == param
        missing = {"model": "missing", "memory_bytes": 1 << 30}
        assert (await http.post("/v1/hetmesh/models", json=missing)).status_code == 404
        assert len(control.added) == 1
        removed = await http.delete("/v1/hetmesh/models/synth-tiny")
        assert removed.json() == {"id": "synth-tiny", "object": "model", "deleted": True}
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["big"]
        assert (await http.delete("/v1/hetmesh/models/synth-tiny")).status_code == 404


async def test_a_one_model_node_has_no_model_routes(nursery: trio.Nursery) -> None:
    backend = Named("big", 64)
    url = await nursery.start(lambda task_status: serve_http(backend, task_status=task_status))
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        body = {"model": "x", "memory_bytes": 1 << 30}
        assert (await http.post("/v1/hetmesh/models", json=body)).status_code == 404


def test_min_replicas_name_models_count_members_and_fit() -> None:
    gib = 1 << 30
    shares = {"a": gib, "b": gib}
    assert check_min_replicas(["a", "b"], shares, {"a": 2}, 3 * gib) == {"a": 2}
    with pytest.raises(InvalidRequest, match="not a --model"):
        check_min_replicas(["a", "b"], shares, {"z": 2}, 3 * gib)
    with pytest.raises(InvalidRequest, match="at least 1"):
        check_min_replicas(["a", "b"], shares, {"a": 0}, 3 * gib)
    with pytest.raises(InvalidRequest, match="--min-replicas needs"):
        check_min_replicas(["a", "b"], shares, {"a": 3}, 3 * gib)  # 4 GiB of members
