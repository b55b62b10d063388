"""Reading the act file of tests/data/acting_app.py (``singleton_testbed.harness.acts``)."""

from __future__ import annotations

from pathlib import Path

from singleton_testbed.harness.acts import spans


def test_each_tokens_span_from_whole_lines_only(tmp_path: Path) -> None:
    log = tmp_path / "acts.log"
    # The last line is being written as it is read: "7 12 8" would be an act at 8 s, long before
    # token 7 really acted, and look like two apps acting at once.
    log.write_text("5 10 100.5\n5 11 101.0\n7 12 102.25\n7 12 8")
    found = {s.token: (s.first, s.last, s.pids) for s in spans(log)}
    assert found == {5: (100.5, 101.0, frozenset({10, 11})), 7: (102.25, 102.25, frozenset({12}))}
    assert spans(tmp_path / "none.log") == []
