from pathlib import Path

import pytest

from hetmesh.cli.node import build_node_config
from hetmesh.errors import InvalidRequest
from hetmesh.node.config import check_settings, load_config_file, merge


def test_config_file_keys_take_dashes_or_underscores(tmp_path: Path):
    f = tmp_path / "node.toml"
    f.write_text(
        'model = "/models/x"\nmax-memory = "2GiB"\nmax_sessions = 3\n'
        'bootstrap = ["/ip4/1.2.3.4/tcp/1/p2p/Qm"]\nplan-strategy = "even"\n'
    )
    settings = load_config_file(f)
    config = build_node_config(settings)
    assert config.max_memory_bytes == 2 * 1024**3
    assert config.bootstrap == ("/ip4/1.2.3.4/tcp/1/p2p/Qm",)
    assert config.serving is not None
    assert config.serving.model == "/models/x"
    assert config.serving.max_sessions == 3
    assert config.serving.plan_strategy == "even"


def test_flags_win_over_the_file_and_the_file_over_defaults(tmp_path: Path):
    file = {"max_sessions": 3, "threads": 2, "model": "from-file"}
    flags = {"max_sessions": 9, "threads": None, "model": None}  # None: flag not given
    config = build_node_config(merge(flags, file))
    assert config.serving is not None
    assert config.serving.max_sessions == 9  # flag
    assert config.serving.threads == 2  # file
    assert config.serving.model == "from-file"
    assert config.serving.max_context_tokens == 2048  # default


def test_environment_reaches_the_config_through_the_flags(monkeypatch, tmp_path: Path):
    from typer.testing import CliRunner

    from hetmesh.cli import app

    seen = {}

    def fake_run(func, config):
        seen["config"] = config

    monkeypatch.setattr("hetmesh.cli.node.trio.run", fake_run)
    monkeypatch.setenv("HETMESH_MESH_SECRET", "from-env")
    f = tmp_path / "n.toml"
    f.write_text('mesh-secret = "from-file"\nmax-sessions = 5\n')
    result = CliRunner().invoke(app, ["node", "start", "--config", str(f), "--no-serve"])
    assert result.exit_code == 0, result.output
    assert seen["config"].mesh_secret == "from-env"  # environment over file
    assert seen["config"].serving is None


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"colour": "blue"}, "unknown setting"),
        ({"max-sessions": "four"}, "wrong type"),
        ({"max-sessions": True}, "wrong type"),
        ({"objective": "speed"}, "must be one of"),
        ({"bootstrap": [1, 2]}, "list of strings"),
    ],
)
def test_bad_settings_are_refused_clearly(raw, match):
    with pytest.raises(InvalidRequest, match=match):
        check_settings(raw, source="test.toml")


def test_bad_toml_and_missing_file(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("model = \n")
    with pytest.raises(InvalidRequest, match="not valid TOML"):
        load_config_file(bad)
    with pytest.raises(InvalidRequest, match="cannot read"):
        load_config_file(tmp_path / "missing.toml")


@pytest.mark.parametrize("key", ["max_context", "max_sessions", "threads"])
def test_non_positive_sizes_are_refused(key):
    with pytest.raises(InvalidRequest, match="at least 1"):
        build_node_config({key: 0})


def test_data_plane_listens_where_peers_reach_the_node():
    from hetmesh.node.serving import data_plane_host

    assert data_plane_host(["/ip4/127.0.0.1/tcp/4001/p2p/Qm"]) == "127.0.0.1"
    lan = ["/ip4/127.0.0.1/tcp/4001/p2p/Qm", "/ip4/10.20.0.2/tcp/4001/p2p/Qm"]
    assert data_plane_host(lan) == "10.20.0.2"
    assert data_plane_host(["/ip6/::1/tcp/1/p2p/Qm"]) == "127.0.0.1"


def test_block_step_override_is_in_seconds_and_must_be_positive():
    config = build_node_config(check_settings({"block-step-ms": 2.5}, source="t.toml"))
    assert config.serving is not None
    assert config.serving.block_step_s == pytest.approx(2.5e-3)
    assert build_node_config({}).serving.block_step_s is None  # measured by default
    for bad in (0, -1.0):
        with pytest.raises(InvalidRequest, match="block-step-ms"):
            build_node_config({"block_step_ms": bad})


def test_a_node_not_told_its_threads_takes_the_cores_it_may_use():
    import os

    from hetmesh.node.config import default_threads
    from hetmesh.testbed.local_mesh import share_threads

    threads = default_threads()
    assert 1 <= threads <= len(os.sched_getaffinity(0))
    assert build_node_config({}).serving.threads == threads
    assert build_node_config({"threads": 3}).serving.threads == 3  # told: kept
    # nodes sharing a host split its cores, one thread each at least
    assert share_threads(1) == threads
    assert share_threads(threads + 1) == 1


def test_the_default_threads_follow_the_affinity_mask():
    import subprocess
    import sys

    probe = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from hetmesh.node.config import default_threads; print(default_threads())"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "1"


def test_an_api_key_equal_to_the_mesh_secret_is_refused(tmp_path: Path):
    # the key is what clients hold: it must not also admit them to the mesh as members
    secret_file = tmp_path / "mesh.secret"
    secret_file.write_text("shared\n")
    for settings in (
        {"api_port": 0, "api_key": "shared", "mesh_secret": "shared"},
        {"api_port": 0, "api_key": "shared", "mesh_secret_file": str(secret_file)},
    ):
        with pytest.raises(InvalidRequest, match="API key is the mesh secret"):
            build_node_config(settings)
    config = build_node_config({"api_port": 0, "api_key": "client", "mesh_secret": "shared"})
    assert (config.api_key, config.mesh_secret) == ("client", "shared")
