"""What gated test apps did, as they record it: every gated app (``tests/data/acting_app.py``)
appends each moment it acts to a file, and no two tokens may ever act at once. The ``gated``
fixture (conftest.py) starts real sidecars around it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from singleton_testbed.harness.acts import spans
from singleton_testbed.harness.sidecars import SidecarProcess
from tests.support.paths import DATA

APP = str(DATA / "acting_app.py")
TIMINGS = {"SINGLETON_LEASE_DURATION": "3", "SINGLETON_RENEW_DEADLINE": "2", "SINGLETON_RETRY_PERIOD": "0.5"}
FINISH = 0.8  # seconds a slow app works on after SIGTERM


def has_acted(log: Path) -> bool:
    """Whether an app has recorded an act in ``log`` yet (the app creates the file when it
    starts, before its first act: a file that exists is no act)."""
    return log.exists() and bool(spans(log))


def idle_gaps(log: Path) -> list[float]:
    """Seconds between one token's last act and the next token's first; negative: both acted at once."""
    ordered = spans(log)
    reach = ordered[0].last if ordered else 0.0
    gaps = []
    for span in ordered[1:]:
        gaps.append(span.first - reach)
        reach = max(reach, span.last)
    return gaps


def assert_never_two_actors(log: Path, *, terms: int) -> list[float]:
    ordered = spans(log)
    assert len(ordered) >= terms, f"expected {terms} terms to act, saw {[s.token for s in ordered]}"
    tokens = [s.token for s in ordered]
    assert tokens == sorted(tokens), f"tokens acted out of order: {tokens}"
    gaps = idle_gaps(log)
    assert all(gap > 0 for gap in gaps), f"two apps acted at once: gaps {gaps}"
    return gaps


def group_gone(pids: frozenset[int]) -> bool:
    return not any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in pids)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


Factory = Callable[..., list[SidecarProcess]]
