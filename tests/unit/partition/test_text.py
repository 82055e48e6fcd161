"""Stop sequences cut a text stream, even when split across deltas."""

from __future__ import annotations

from hetmesh.partition.text import StopMatcher


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = ""
    for delta in deltas:
        out += matcher.feed(delta)
        if matcher.stopped:
            break
    out += matcher.flush()
    return out, matcher.stopped


def test_stop_sequence_split_across_deltas() -> None:
    assert _run(["END"], ["hello E", "N", "D and more"]) == ("hello ", True)


def test_partial_prefix_that_does_not_complete_is_released() -> None:
    assert _run(["END"], ["a E", "Nx", " b"]) == ("a ENx b", False)


def test_no_stops_passes_text_through_unchanged() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("anything END") == "anything END"
    assert not matcher.stopped


def test_earliest_of_several_stops_wins() -> None:
    assert _run(["\n\n", "Q:"], ["answer Q: x\n\n"]) == ("answer ", True)
