"""The per-stage overhead the cost model charges, recovered from measured token times."""

from __future__ import annotations

import pytest

from hetmesh.node.calibration import stage_overhead_from_tokens
from hetmesh.scheduler.cost import Assignment, CostModel
from hetmesh.scheduler.records import PlanConstraints
from tests.unit.scheduler.sched_helpers import device, full_links, toy_model


@pytest.mark.parametrize(
    ("token_s", "steps", "expected"),
    [
        (0.062, [0.020, 0.034], 0.004),  # 8 ms outside two stages' compute
        (0.050, [0.050], 0.0),  # nothing left over
        (0.040, [0.030, 0.030], 0.0),  # steps measured longer than the token: never negative
        (0.030, [0.008, 0.008, 0.008], 0.002),
    ],
)
def test_stage_overhead_from_tokens_spreads_the_rest_over_the_stages(
    token_s: float, steps: list[float], expected: float
) -> None:
    assert stage_overhead_from_tokens(token_s, steps) == pytest.approx(expected)


@pytest.mark.parametrize(("token_s", "steps"), [(0.05, []), (0.0, [0.01]), (0.05, [0.0])])
def test_stage_overhead_from_tokens_refuses_nonsense(token_s: float, steps: list[float]) -> None:
    with pytest.raises(ValueError, match=r"stage|positive"):
        stage_overhead_from_tokens(token_s, steps)


def test_recovered_overhead_closes_the_gap_between_prediction_and_token_time() -> None:
    """Feeding back what a pipeline measured makes its prediction equal the token time."""
    model = toy_model(layers=8)
    devices = [device("a", backend="cpu"), device("b", backend="cpu")]
    links = full_links(devices, bandwidth=1e12, rtt=0.0)
    bare = PlanConstraints(stage_overhead_s=0.0, reserve_bytes=0, reserve_fraction=0.0)
    stages = CostModel(model, devices, links, bare)
    split = [Assignment(0, 0, 5), Assignment(1, 5, model.num_units)]
    steps = [stages.step_s(0, 0, 5), stages.step_s(1, 5, model.num_units)]
    token_s = sum(steps) + 0.009  # a run that spent 9 ms per token outside the stages
    fitted = stage_overhead_from_tokens(token_s, steps)
    calibrated = CostModel(
        model, devices, links, PlanConstraints(stage_overhead_s=fitted, reserve_bytes=0)
    )
    assert calibrated.pipeline(split).decode_latency_s == pytest.approx(token_s)
    assert stages.pipeline(split).decode_latency_s < token_s * 0.99
