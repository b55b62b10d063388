"""Valid timings for the backend tests, built around the lease duration each test waits on."""

from __future__ import annotations

from singleton_election.core.timings import Timings


def timings_for(lease_duration: float, renew_deadline: float | None = None) -> Timings:
    """Timings with this lease duration; the renew deadline half of it unless given. The
    backends read no retry period, so it is only made valid: half the renew deadline."""
    renew = lease_duration / 2 if renew_deadline is None else renew_deadline
    return Timings(lease_duration=lease_duration, renew_deadline=renew, retry_period=renew / 2)
