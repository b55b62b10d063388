"""Ports handed out to the test bed's servers: each pytest-xdist worker draws from its own slice."""

from __future__ import annotations

import pytest

from singleton_testbed import procs


@pytest.mark.parametrize(("worker", "count", "expected"), [
    ("gw0", "3", range(20000, 23333)),
    ("gw2", "3", range(26666, 29999)),
    ("gw1", "1", range(20000, 30000)),  # one worker: the whole range
    ("", "", range(20000, 30000)),  # not under xdist
])
def test_each_worker_draws_from_a_slice_of_its_own(
    monkeypatch: pytest.MonkeyPatch, worker: str, count: str, expected: range
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
    assert procs._ports_of_this_worker() == expected


def test_the_slices_of_all_workers_do_not_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    seen: set[int] = set()
    for index in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        ports = set(procs._ports_of_this_worker())
        assert not ports & seen
        seen |= ports
    assert len(seen) == 9999


def test_a_port_handed_out_comes_from_this_workers_slice() -> None:
    port = procs.free_port()
    assert port in procs._PORTS and port in procs._handed
