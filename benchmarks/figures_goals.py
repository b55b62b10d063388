"""The goals of issue 35, checked from a figures document (not in timed tests):

- ours ahead of client-go in every row that compares: a lower p99 than client-go's, measured by
  the same script with the same fault; where the figure counts runs with two leaders at once,
  fewer such runs than client-go's, or none on both sides;
- the operator's burst: p99 at most ``BURST_RATIO`` times its floor's, measured in the same run,
  at each size;
- the pooled mode: no group left without a leader after its leader's worker was killed.

``python -m benchmarks.figures --check`` prints every goal and exits 1 when one is missed; the
rendering writes a missed goal into its row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.figures_model import CLIENT_GO, FLOOR, Document, Fact, Figure, duration, quantity

BURST_RATIO = 1.2
"""The operator's burst p99 against the floor's, at each size."""
BOTH_LEADING = "runs_both_leading"
LEADERLESS = "leaderless_groups"


@dataclass(frozen=True)
class GoalResult:
    row: str
    figure: str
    goal: str
    met: bool
    detail: str
    """The figures the verdict rests on, in words."""


def check(document: Document) -> list[GoalResult]:
    """Every goal the document's figures bear on, in the order of its figures."""
    results: list[GoalResult] = []
    for figure in document.figures:
        results += check_figure(figure)
    return results


def check_figure(figure: Figure) -> list[GoalResult]:
    counterpart = figure.counterpart
    if counterpart is not None and counterpart.peer == CLIENT_GO:
        return _ahead_of_clientgo(figure)
    if counterpart is not None and counterpart.peer == FLOOR:
        return [_within_floor(figure)]
    if LEADERLESS in figure.facts and figure.id == "pooled.failover":
        return [_no_group_leaderless(figure)]
    return []


def missed(results: Sequence[GoalResult]) -> list[GoalResult]:
    return [r for r in results if not r.met]


GOAL_FIGURES = {"handover": "handover.vs-clientgo", "sigkill": "sigkill.vs-clientgo",
                "partition-api": "partition-api.vs-clientgo", "requests": "requests.vs-clientgo",
                "pooled": "pooled.failover", "burst": "burst."}
"""The figure (or the prefix of the figures) each goal of a row is checked on."""


def unchecked(document: Document) -> list[str]:
    """The rows the document measured whose goals have no figure to be checked on."""
    return [row for row, wanted in GOAL_FIGURES.items() if row in document.rows
            and not any(f.id == wanted or (wanted.endswith(".") and f.id.startswith(wanted))
                        for f in document.figures)]


def _ahead_of_clientgo(figure: Figure) -> list[GoalResult]:
    assert figure.counterpart is not None
    ours, theirs = figure.stats, figure.counterpart.stats
    results = [GoalResult(figure.row, figure.id, "ours ahead of client-go (p99, lower is better)",
                          ours.p99 < theirs.p99,
                          f"ours {quantity(ours.p99, ours.unit)} against client-go's "
                          f"{quantity(theirs.p99, theirs.unit)}")]
    if BOTH_LEADING in figure.facts:
        mine, its = _count(figure.facts[BOTH_LEADING]), _count(figure.counterpart.facts.get(BOTH_LEADING, 0))
        results.append(GoalResult(figure.row, figure.id, "ours ahead of client-go (runs with both leading at once)",
                                  mine < its or mine == its == 0,
                                  f"ours {mine} of {ours.n} runs, client-go {its} of {theirs.n}"))
    return results


def _within_floor(figure: Figure) -> GoalResult:
    assert figure.counterpart is not None
    ours, floor = figure.stats.p99, figure.counterpart.stats.p99
    ratio = ours / floor if floor > 0 else float("inf")
    return GoalResult(figure.row, figure.id, f"operator burst p99 ≤ {BURST_RATIO:g} times the floor's",
                      ratio <= BURST_RATIO,
                      f"{figure.column} groups: {duration(ours)} against the floor's {duration(floor)}, "
                      f"ratio {ratio:.2f}")


def _no_group_leaderless(figure: Figure) -> GoalResult:
    left = _count(figure.facts[LEADERLESS])
    return GoalResult(figure.row, figure.id, "pooled mode: 0 groups left without a leader", left == 0,
                      f"{left} of {_count(figure.facts.get('killed_leaders', 0))} groups whose leader was killed")


def _count(value: Fact) -> int:
    if isinstance(value, str):
        raise ValueError(f"not a count: {value!r}")
    return int(value)

