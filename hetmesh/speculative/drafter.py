"""What the gateway asks of a drafter and of a draft budget (issue 48).

These two protocols are the seam between the mesh path (the gateway sends a
session's drafts as one step; the stages verify them) and what proposes drafts
and chooses how many: prompt lookup, a draft model at the gateway, a budget
that learns from the route's measured steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    """Proposes draft tokens for one session, deterministically.

    A drafter whose ``propose`` computes (a draft model's forwards) says so with a
    true ``blocking`` attribute: the gateway then calls its ``propose`` and ``close``
    on a worker thread, not on the node's event loop. Without it (prompt lookup:
    microseconds) they are called inline.
    """

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """At most ``k`` token ids likely to follow ``history`` (the prompt and every
        token the session has delivered); empty when it has no guess. The same
        history gives the same drafts, so a verified step can be replayed."""
        ...

    def close(self) -> None:
        """Let go of what the drafter holds for its session (a draft model's KV)."""
        ...


class Budget(Protocol):
    """Chooses how many drafts a session's next step carries, from what it measured.

    A budget may also have ``no_drafts()``: the gateway calls it when the drafts
    ``k()`` asked for did not come (the drafter had none) and the step went plain.
    """

    def k(self) -> int:
        """Drafts for the next step: 0 decodes plainly."""
        ...

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        """One step came back: ``drafted`` drafts were sent with it, ``accepted`` of
        them were kept (the target's own token comes on top), and the step took
        ``seconds`` from sending it to its last token (0 drafts: a plain step)."""
        ...
