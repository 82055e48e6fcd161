from dataclasses import dataclass

import pytest

from hetmesh.errors import InvalidRequest, Rejected
from hetmesh.node.kvcache import KVLimits, KVManager


@dataclass
class FakeCache:
    nbytes: int = 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(max_sessions=2, max_tokens=100, budget=1000, idle=10.0, per_token=5):
    clock = Clock()
    manager = KVManager(
        KVLimits(max_sessions, max_tokens, budget, idle),
        bytes_per_token=per_token,
        factory=FakeCache,
        clock=clock,
    )
    return manager, clock


def test_kvcache_reserves_and_frees_budget():
    kv, _ = make()
    kv.open("a", 100)  # 500 bytes
    kv.open("b", 100)  # 1000 bytes: full
    assert kv.bytes_reserved == 1000
    with pytest.raises(Rejected, match="busy"):
        kv.open("c", 1)
    assert kv.close("a")
    kv.open("c", 100)
    assert kv.statistics().sessions == 2
    assert kv.statistics().rejected_busy == 1


@pytest.mark.parametrize("tokens", [0, -3, 101])
def test_kvcache_refuses_impossible_sessions(tokens):
    kv, _ = make()
    with pytest.raises(InvalidRequest):
        kv.open("a", tokens)
    assert kv.statistics().sessions == 0


def test_kvcache_refuses_session_larger_than_budget():
    kv, _ = make(budget=100, per_token=5)
    with pytest.raises(InvalidRequest, match="whole budget"):
        kv.open("a", 21)


def test_kvcache_unknown_and_duplicate_sessions():
    kv, _ = make()
    with pytest.raises(InvalidRequest, match="unknown session"):
        kv.get("nope")
    kv.open("a", 1)
    with pytest.raises(InvalidRequest, match="already open"):
        kv.open("a", 1)
    assert not kv.close("nope")


def test_kvcache_expires_only_idle_sessions():
    kv, clock = make(idle=10.0)
    kv.open("old", 1)
    clock.now = 6.0
    kv.open("new", 1)
    clock.now = 12.0
    assert kv.expire_idle() == ["old"]
    assert "new" in kv
    assert "old" not in kv
    kv.get("new")  # touching keeps it alive
    clock.now = 21.0
    assert kv.expire_idle() == []
    assert kv.statistics().expired == 1


def test_kvcache_reports_bytes_used_by_caches():
    kv, _ = make()
    cache = kv.open("a", 10)
    cache.nbytes = 123
    assert kv.statistics().bytes_used == 123
