"""What a gateway drafts with, from the node's switches (issue 48).

``hetmesh node start --speculative`` drafts with prompt lookup and lets the
measured budget (:class:`~hetmesh.speculative.budget.SpeculationBudget`, up to
``k`` drafts) choose each step's drafts; ``--speculative-k N`` drafts ``N``
every step (a fixed budget: for comparisons); ``--draft FORMAT`` drafts with a
copy of the served model in ``FORMAT`` at the gateway
(:mod:`hetmesh.speculative.draft_model`) instead of prompt lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hetmesh.speculative.accept import FixedBudget
from hetmesh.speculative.budget import SpeculationBudget
from hetmesh.speculative.lookup import PromptLookup

if TYPE_CHECKING:
    from hetmesh.speculative.draft_model import DraftModel

LOOKUP = "lookup"  # --draft's value for prompt lookup (the default)

Speculation = Callable[[], tuple[Any, Any]]  # a (Drafter, Budget) for each request


def gateway_speculation(
    k: int, *, measured: bool, model: DraftModel | None = None
) -> Speculation | None:
    """A drafter and a budget for each request entering the gateway; None for ``k`` 0.

    ``measured``: the budget chooses up to ``k`` drafts a step from what it measures
    (counting ``model``'s drafting time), else ``k`` every step. ``model``: drafts
    from that model, else prompt lookup.
    """
    if k <= 0:
        return None

    def make() -> tuple[Any, Any]:
        if model is None:
            drafter: Any = PromptLookup()
            overhead = None
        else:
            drafter = model.drafter()
            overhead = lambda: drafter.last_s  # noqa: E731
        if measured:
            return drafter, SpeculationBudget(max_k=k, overhead_s=overhead)
        return drafter, FixedBudget(k)

    return make


__all__ = ["LOOKUP", "Speculation", "gateway_speculation"]
