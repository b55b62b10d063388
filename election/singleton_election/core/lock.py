"""The one small interface every lock backend implements, and the records that cross it.

Owned by the election core (``singleton_election.core.elector``); implemented by
``backends.postgres.session_mode``, ``backends.lease`` and ``backends.both``. The interface carries
its state explicitly: the version a backend observed travels in the ``Term`` and
``LockRecord`` values, so no call order is hidden inside a backend.

Rules every implementation keeps:
- losing a race is a value (``LockRecord`` from ``acquire``, ``None`` from ``renew``),
  never an exception;
- every failure to reach the store (timeouts, lost connections, 5xx) is raised as
  ``BackendUnavailable`` chained to the original error; the elector steps down on it;
- every call finishes within the timeout it is given;
- a backend that learns on its own that a held lock is gone (a dropped database
  connection) calls the loss callback at once, so the elector steps down without
  waiting for the next renewal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NewType, Protocol

Identity = NewType("Identity", str)
"""A candidate's identity: unique per process incarnation (pod name, pod UID, start nonce)."""

Token = NewType("Token", int)
"""A fencing token: strictly greater than every earlier token of the group."""


class BackendUnavailable(Exception):
    """The lock store could not be reached or did not answer in time."""


class ForceReleaseFailed(Exception):
    """A force release (``kubectl singleton release``, carried out by the operator) could not be
    carried out; the message says why."""


class BackendMisconfigured(Exception):
    """The store answers, but is set up so that its lock cannot be trusted (for example a
    connection pooler in transaction mode in front of PostgreSQL). Never retried: the
    sidecar exits with status 2 and the message, which says what to change."""


@dataclass(frozen=True)
class LockRecord:
    """What a backend observed of the lock: who holds it, with which token.

    ``holder`` is ``None`` when the lock is free (released or never taken).
    ``version`` is the store's opaque version of the record (a resourceVersion, a row
    version) at the time of observation.
    """

    holder: Identity | None
    token: Token | None
    version: str = ""


@dataclass(frozen=True)
class Term:
    """One term of leadership held by ``identity`` with ``token``.

    ``version`` is the store's version after the last successful write by this holder;
    the next renewal or release is conditional on it. ``written_at`` is the local
    monotonic time (from the backend's injected clock) taken just BEFORE the write that
    began or last extended the term: the elector's renew deadline counts from it, so
    the deadline can only be early, never late.
    """

    identity: Identity
    token: Token
    version: str = ""
    written_at: float = 0.0
    acting_from: float = 0.0
    """Local monotonic time from which the term may act. A backend that takes over a term its
    holder did not release (a crash, a dropped session) sets it to when that holder's app
    is surely stopped; the elector holds the term, renewed, without acting until then."""


LossCallback = Callable[[str], None]
"""Called with a reason when the backend learns that the held lock is gone."""


class LockBackend(Protocol):
    """A lock store for one group. See the module docstring for the rules."""

    @property
    def name(self) -> str:
        """Short name for logs and metrics: ``postgres``, ``lease`` or ``both``."""
        ...

    async def acquire(self, identity: Identity, *, timeout: float) -> Term | LockRecord:
        """Wait up to ``timeout`` seconds for the lock and take it with a new token.

        Returns the new ``Term``, or the ``LockRecord`` of the current holder when the
        lock was not free (or was lost in a race) within the timeout. A standby calls
        this in a loop; backends should wake as soon as the lock frees (blocking lock
        wait, watch, notification) rather than poll. The wait ends within ``timeout``; the
        report of what it found may come a little later on a loaded machine, which is better
        than reporting the store unavailable.
        """
        ...

    async def renew(self, term: Term, *, timeout: float) -> Term | None:
        """Extend ``term``; return the updated term, or ``None`` if it is no longer ours."""
        ...

    async def release(self, term: Term, *, timeout: float) -> None:
        """Give the lock up so a standby can take it at once. Idempotent."""
        ...

    async def observe(self, *, timeout: float) -> LockRecord:
        """Read the current holder and token without changing anything."""
        ...

    def set_loss_callback(self, callback: LossCallback) -> None:
        """Register the callback for an asynchronously detected loss of the held lock."""
        ...

    async def close(self) -> None:
        """Free every resource (connections, watches). Does not release a held term."""
        ...
