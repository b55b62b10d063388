"""The act file of ``tests/data/acting_app.py``: one ``<token> <pid> <monotonic time>`` line per
act, from every replica of a group (CLOCK_MONOTONIC is one clock for every process of the
machine, containers of either real node included), read back as each token's acting span."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Span:
    token: int
    first: float
    last: float
    pids: frozenset[int]


def spans(log: Path) -> list[Span]:
    """Each token's acting span (first to last recorded act), in order of first act."""
    seen: dict[int, tuple[float, float, set[int]]] = {}
    text = log.read_text() if log.exists() else ""
    # Only whole lines: a read may end inside a line being written (``TOKEN PID 8``, cut short).
    for line in text[:text.rfind("\n") + 1].splitlines():
        fields = line.split()
        if len(fields) != 3:
            continue
        token, pid, at = int(fields[0]), int(fields[1]), float(fields[2])
        first, last, pids = seen.get(token, (at, at, set()))
        pids.add(pid)
        seen[token] = (min(first, at), max(last, at), pids)
    return sorted((Span(t, f, la, frozenset(p)) for t, (f, la, p) in seen.items()), key=lambda s: s.first)
