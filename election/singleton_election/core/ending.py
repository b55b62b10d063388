"""How a term ends: the pure decision the leader loop takes on every turn.

Every way a term ends goes through the same three steps, in this order (``Elector._finish``):

1. **publish** the new role (readiness drops, the gate is told, ``/leader`` says so);
2. **stop** the app and wait until it *has* stopped (exec gate: the whole process group
   is dead; file gate: ``gate.sh`` acknowledged ``idle``; cooperative: the drain hook or
   the SDK answered), bounded: past the bound the gate has killed it;
3. **release** the lock, and only then may another candidate lead.

An ending is *graceful* (step-down, handover, drain) or *forced* (renew deadline passed,
lock lost). A graceful ending first drains: the term stays renewed while the app finishes
its in-flight work, up to the drain timeout. A forced ending stops the app at once.

This module decides which, from a snapshot of the loop's state; it does no I/O, so every
case is table-tested (``tests/unit/election/test_elector.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from singleton_election.core.status import Role
from singleton_election.core.timings import Timings


class Action(enum.Enum):
    LEAD = "lead"
    """Keep leading: renew when due."""
    DRAIN = "drain"
    """Begin a graceful ending: publish DRAINING, let the app finish, keep renewing."""
    FINISH = "finish"
    """Publish the final role, stop the app, release."""


@dataclass(frozen=True)
class LeadState:
    """What the leader loop knows at one moment (monotonic seconds)."""

    now: float
    deadline: float
    """The renew deadline: the last good write + ``renew_deadline``."""
    lost_reason: str | None = None
    """Set when the backend reported the lock gone, or a renewal found another holder."""
    drain_requested: bool = False
    """The pod (or process) is going away: drain, release, and campaign no more."""
    step_down_reason: str | None = None
    """Give this term up (handover, ``/step-down``), then campaign again later."""
    draining: bool = False
    """A graceful ending is under way."""
    drain_done: bool = False
    """The drain step finished (the app stopped, or the drain timeout passed)."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    then: Role = Role.STANDBY
    """The role published at FINISH: RELEASED when no longer campaigning."""
    pause: float = 0.0
    """Seconds to wait after the release before campaigning again."""
    urgent: bool = False
    """The lock is already gone (the store freed it): another candidate may lead now, so the
    app is killed at once rather than given its grace."""


def decide(state: LeadState, timings: Timings) -> Decision:
    """The next step of the leader loop. Forced endings win over graceful ones: a term whose
    deadline passed cannot be drained any longer, it may only stop."""
    then = Role.RELEASED if state.drain_requested else Role.STANDBY
    if state.lost_reason is not None:
        return Decision(Action.FINISH, f"stepped down: {state.lost_reason}", then, timings.retry_period, urgent=True)
    if state.now >= state.deadline:
        return Decision(Action.FINISH,
                        f"stepped down: no successful renewal within renew_deadline ({timings.renew_deadline:g}s)",
                        then, timings.retry_period)
    if state.draining and state.drain_done:
        if state.drain_requested:
            return Decision(Action.FINISH, "released: no longer campaigning", Role.RELEASED)
        # A planned handover: stand aside for a lease duration so another candidate takes it.
        return Decision(Action.FINISH, f"stepped down: {state.step_down_reason}", Role.STANDBY,
                        timings.lease_duration)
    if not state.draining and (state.drain_requested or state.step_down_reason is not None):
        reason = ("draining: finishing in-flight work" if state.drain_requested
                  else f"stepping down: {state.step_down_reason}")
        return Decision(Action.DRAIN, reason)
    return Decision(Action.LEAD)
