"""``hetmesh node start`` with the gateway's drafts chosen by bench/speculative.py (issue 48).

Until the node wires the draft model and the measured budget (a flag for each),
the benchmark starts its nodes through this file::

    python bench/speculative_node.py --bench-drafter int4 --bench-budget measured \\
        node start ... --speculative-k 8

It replaces the gateway's speculation factory (``hetmesh.node.serving.speculation``,
called with ``--speculative-k``) before the CLI runs: ``--bench-drafter`` ``lookup``
(prompt lookup) or ``int4`` (an int4 copy of the default model, loaded once per
node), ``--bench-budget`` ``fixed`` (k drafts every step) or ``measured``
(:class:`~hetmesh.speculative.budget.SpeculationBudget` of up to k). Nothing else
of the node changes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def factory(drafter: str, budget: str) -> Callable[[int], Any]:
    def speculation(k: int) -> Any:
        if k <= 0:
            return None
        from hetmesh.speculative.accept import FixedBudget
        from hetmesh.speculative.budget import SpeculationBudget
        from hetmesh.speculative.lookup import PromptLookup

        model = None
        if drafter == "int4":
            from hetmesh.partition.store import resolve_model
            from hetmesh.speculative.draft_model import DraftModel

            model = DraftModel.load(resolve_model(), weights="int4")

        def make() -> Any:
            if model is not None:
                d: Any = model.drafter()
                overhead = lambda: d.last_s  # noqa: E731
            else:
                d, overhead = PromptLookup(), None
            if budget == "measured":
                return d, SpeculationBudget(max_k=k, overhead_s=overhead)
            return d, FixedBudget(k)

        return make

    return speculation


def main() -> None:
    argv = sys.argv[1:]
    choices = {"--bench-drafter": "lookup", "--bench-budget": "fixed"}
    while argv and argv[0] in choices:
        choices[argv[0]] = argv[1]
        argv = argv[2:]
    if choices["--bench-drafter"] not in ("lookup", "int4"):
        raise SystemExit(f"--bench-drafter lookup|int4, not {choices['--bench-drafter']}")
    if choices["--bench-budget"] not in ("fixed", "measured"):
        raise SystemExit(f"--bench-budget fixed|measured, not {choices['--bench-budget']}")
    import hetmesh.node.serving as serving

    serving.speculation = factory(choices["--bench-drafter"], choices["--bench-budget"])  # type: ignore[assignment]
    from hetmesh.cli import main as cli_main

    sys.argv = ["hetmesh", *argv]
    cli_main()


if __name__ == "__main__":
    main()
