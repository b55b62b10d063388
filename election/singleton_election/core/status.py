"""Roles and the immutable status snapshot the elector publishes on every change."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from singleton_election.core.lock import Identity, Term, Token


class Role(enum.StrEnum):
    STANDBY = "standby"
    """Campaigning: not acting; waits for the lock."""
    LEADER = "leader"
    """Holds the lock and renews it: the only replica that may act."""
    DRAINING = "draining"
    """Still holds the lock while the app finishes in-flight work; takes no new work."""
    RELEASED = "released"
    """Gave the lock up for good (pod going away); no longer campaigns."""


@dataclass(frozen=True)
class ElectionStatus:
    """What one candidate knows at one moment. ``leader_since`` is wall-clock epoch seconds."""

    group: str
    identity: Identity
    role: Role
    term: Term | None
    leader: Identity | None
    leader_token: Token | None
    leader_since: float | None
    transitions: int
    reason: str

    @property
    def token(self) -> Token | None:
        return self.term.token if self.term is not None else None
