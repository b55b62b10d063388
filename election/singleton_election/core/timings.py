"""Election timings of one group, validated once at start."""

from __future__ import annotations

import math
from dataclasses import dataclass

JITTER_FACTOR = 1.2
"""client-go's rule: the renew deadline must leave room for a jittered retry."""

MIN_CLOCK_MARGIN = 0.5
"""Seconds between the renew deadline and the lease duration at the least: the room a
stepping-down leader has to stop its work, and the slack for clock-rate drift."""


def _nanoseconds(seconds: float) -> int:
    """Whole nanoseconds. The rules compare these, not the floats: timings come from durations
    exact to the nanosecond (the CRD's, compared exactly at admission), and in floats
    0.7 - 0.2 < 0.5, so a sidecar would refuse 700ms/200ms that admission accepted. Exact for
    any duration below 10^6 s (the float is within 0.1 ns of it)."""
    return round(seconds * 1_000_000_000)


MIN_RETRY_PERIOD = 0.1
"""Seconds between renewals at the least: faster renewals are API or database load, not safety."""

MAX_LEASE_DURATION = 300.0
"""Seconds a lock may stay valid without a renewal at the most (5 minutes)."""

FIELDS = ("lease_duration", "renew_deadline", "retry_period")


class TimingError(ValueError):
    """Timings that break a rule. ``field`` is the timing the rule is about; ``rule`` says it,
    naming the other timings as ``{lease_duration}`` and so on, so that each reader of timings
    (the sidecar's flags, the operator's CRD fields) can say it in its own names (``render``)."""

    def __init__(self, field: str, rule: str, values: dict[str, object]) -> None:
        self.field, self.rule = field, rule
        super().__init__(self.render({name: f"{name} ({_shown(values[name])})" for name in FIELDS}))

    def render(self, names: dict[str, str]) -> str:
        return f"{names[self.field]}: {self.rule.format(**names)}"


def _shown(value: object) -> str:
    return f"{value:g}s" if isinstance(value, int | float) and not isinstance(value, bool) else repr(value)


def check_timings(lease_duration: object, renew_deadline: object, retry_period: object) -> None:
    """The one rule set of timings: positive finite numbers, then the CRD's validation rules in
    their order (the CRD says them again in CEL, for admission, where its schema's pattern
    already refuses a zero or negative duration; tests/integration/kube/test_crd.py checks that both agree to
    the nanosecond). Raises ``TimingError`` on the first broken rule."""
    values: dict[str, object] = {"lease_duration": lease_duration, "renew_deadline": renew_deadline,
                                 "retry_period": retry_period}
    for name, value in values.items():
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or not (value > 0 and math.isfinite(value)):  # type: ignore[operator, arg-type]
            raise TimingError(name, "must be a positive number of seconds", values)
    lease, renew, retry = (_nanoseconds(v) for v in values.values())  # type: ignore[arg-type]
    if renew >= lease:
        raise TimingError("renew_deadline", "must be shorter than {lease_duration}", values)
    if renew > lease - _nanoseconds(MIN_CLOCK_MARGIN):
        raise TimingError("renew_deadline", f"must be at least {MIN_CLOCK_MARGIN:g}s shorter than {{lease_duration}} "
                          "(margin for clock drift and jitter)", values)
    if retry >= renew:
        raise TimingError("retry_period", "must be shorter than {renew_deadline}", values)
    if renew * 5 <= retry * 6:  # renew <= JITTER_FACTOR (6/5) x retry, in integers
        raise TimingError("renew_deadline", f"must be more than {JITTER_FACTOR:g} times {{retry_period}}, so the "
                          "leader can retry a failed renewal before the deadline", values)
    if retry < _nanoseconds(MIN_RETRY_PERIOD):
        raise TimingError("retry_period", f"must be at least {MIN_RETRY_PERIOD:g}s (100ms)", values)
    if lease > _nanoseconds(MAX_LEASE_DURATION):
        raise TimingError("lease_duration", f"must be at most {MAX_LEASE_DURATION:g}s (5m)", values)


@dataclass(frozen=True)
class Timings:
    """How fast a group elects, renews and gives up.

    A leader renews every ``retry_period``; if no renewal has succeeded within
    ``renew_deadline`` of the last good one it steps down at once. Others may take the
    lock only after ``lease_duration`` without a renewal (lease backend, and stalled
    holders on postgres), so ``lease_duration - renew_deadline`` is the time an ex-leader
    has to stop acting. ``check_timings`` holds the rules.
    """

    lease_duration: float = 6.0
    """Seconds a lock stays valid after its last renewal, as seen by other candidates."""
    renew_deadline: float = 4.0
    """Seconds the leader keeps trying to renew before it steps down."""
    retry_period: float = 2.0
    """Seconds between renewals, and between acquisition attempts after an error."""

    def __post_init__(self) -> None:
        check_timings(self.lease_duration, self.renew_deadline, self.retry_period)

    @property
    def stop_margin(self) -> float:
        """Seconds an ex-leader has, after its renew deadline, to stop before anyone else may act."""
        return self.lease_duration - self.renew_deadline


BACKEND_DEFAULTS: dict[str, Timings] = {
    # A renewal is one query on a connection the holder keeps anyway; a crash frees the
    # lock at once, so the lease duration only bounds the stalled-holder case.
    "postgres": Timings(lease_duration=6.0, renew_deadline=4.0, retry_period=2.0),
    # Every renewal is an etcd write. Renewing every 6 s, plus each sidecar's two watches
    # (its Lease, its pod) re-established every ~5 min, keeps a group of 3 at 0.19 API
    # requests/s at rest, under the 0.2 goal; a crashed leader's Lease expires within 9 s.
    "lease": Timings(lease_duration=9.0, renew_deadline=7.5, retry_period=6.0),
    "both": Timings(lease_duration=9.0, renew_deadline=7.5, retry_period=6.0),
}
"""Timings used for each backend when none are given."""


def default_timings(backend: str, **given: float) -> Timings:
    """The backend's default timings, with any of the three given ones in their place."""
    base = BACKEND_DEFAULTS[backend]
    values = {"lease_duration": base.lease_duration, "renew_deadline": base.renew_deadline,
              "retry_period": base.retry_period, **given}
    return Timings(**values)
