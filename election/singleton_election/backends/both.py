"""Both stores at once: lead only while holding the PostgreSQL lock AND the Lease.

The term's fencing token is PostgreSQL's (the Lease keeps its own counter in its
annotation). Losing either lock ends the term: the loss callback of either backend is
ours, and a renewal that fails on either side fails as a whole.

Tokens obey the rule of every backend (a new token is above the previous one, the wall
clock in milliseconds and every token seen) exactly as far as PostgreSQL's do: nothing here
computes a token, and a term's token is the one PostgreSQL issued for it (the greatest of
the row's previous token + 1, the database's clock in milliseconds and its sequence). The
Lease's own counter follows the lease backend's rule, which does not see PostgreSQL's
tokens except on the pods (the leader's pod carries the term's token): so after a switch to
``lease`` alone, the first Lease term of each new process continues above this era's
tokens while the old leader's pod still carries its token, and otherwise above the node's
clock only. The reverse switch (``lease`` to ``both``) relies on the database's clock not
being behind the clocks that issued the lease era's tokens by more than the time since.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from singleton_election.backends.lease import LeaseBackend
from singleton_election.core.lock import (
    BackendUnavailable,
    Identity,
    LockBackend,
    LockRecord,
    LossCallback,
    Term,
)

_POSTGRES_RESERVE_MAX = 0.5  # seconds of an acquire's budget kept for PostgreSQL after the Lease


class BothBackend:
    def __init__(self, *, postgres: LockBackend, lease: LeaseBackend,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.postgres = postgres
        self.lease = lease
        self._clock = clock
        # The two underlying terms of our current term, by its token.
        self._parts: dict[int, tuple[Term, Term]] = {}

    @property
    def name(self) -> str:
        return "both"

    def __repr__(self) -> str:
        return f"<BothBackend postgres={self.postgres!r} lease={self.lease!r}>"

    def set_loss_callback(self, callback: LossCallback) -> None:
        self.postgres.set_loss_callback(lambda reason: callback(f"postgres: {reason}"))
        self.lease.set_loss_callback(lambda reason: callback(f"lease: {reason}"))

    async def acquire(self, identity: Identity, *, timeout: float) -> Term | LockRecord:
        started = self._clock()

        def remaining() -> float:
            return max(timeout - (self._clock() - started), 0.05)

        # The Lease first, then PostgreSQL. A standby waits on the Lease's watch holding
        # nothing, and only the one candidate that wins the Lease goes on to the PostgreSQL
        # lock: the others never wait on that lock, where they would get it the instant its
        # holder's session ends (a killed sidecar) and keep out the one candidate that may take
        # the Lease at once, the holder's restarted incarnation (core.identity.is_predecessor).
        # The term's token is PostgreSQL's, so the holder is reported as PostgreSQL sees it.
        reserve = min(_POSTGRES_RESERVE_MAX, timeout / 4)
        lease = await self.lease.acquire(identity, timeout=timeout - reserve)
        if not isinstance(lease, Term):
            return await self.postgres.observe(timeout=remaining())
        try:
            pg = await self.postgres.acquire(identity, timeout=remaining())
        except BaseException:
            await self.lease.release(lease, timeout=2.0)
            raise
        if not isinstance(pg, Term):
            # Held by a leader that lost its Lease and stops its app first: the Lease goes
            # back, for whichever candidate waits on PostgreSQL once that lock is free.
            await self.lease.release(lease, timeout=2.0)
            return pg
        return self._combine(pg, lease)

    def _combine(self, pg: Term, lease: Term) -> Term:
        self._parts = {pg.token: (pg, lease)}
        return Term(identity=pg.identity, token=pg.token, version=f"{pg.version}|{lease.version}",
                    written_at=min(pg.written_at, lease.written_at),
                    acting_from=max(pg.acting_from, lease.acting_from))

    def _split(self, term: Term) -> tuple[Term, Term] | None:
        return self._parts.get(term.token)

    async def renew(self, term: Term, *, timeout: float) -> Term | None:
        parts = self._split(term)
        if parts is None:
            return None
        pg, lease = parts
        results = await asyncio.gather(self.postgres.renew(pg, timeout=timeout),
                                       self.lease.renew(lease, timeout=timeout), return_exceptions=True)
        new_pg, new_lease = results
        # Keep each side's own progress even when the other failed: a release must name the
        # term as the store last saw it, or it would free nothing.
        self._parts = {term.token: (new_pg if isinstance(new_pg, Term) else pg,
                                    new_lease if isinstance(new_lease, Term) else lease)}
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, BackendUnavailable):
                raise result
        if new_pg is None or new_lease is None:
            # The other half stays held until the elector releases the term, which it does
            # only once the app has stopped: released here, it would let a candidate that
            # holds the lost half take over while this app still acts.
            return None
        if isinstance(new_pg, BackendUnavailable):
            raise new_pg
        if isinstance(new_lease, BackendUnavailable):
            raise new_lease
        assert isinstance(new_pg, Term) and isinstance(new_lease, Term)
        return self._combine(new_pg, new_lease)

    async def release(self, term: Term, *, timeout: float) -> None:
        parts = self._split(term)
        if parts is None:
            return
        pg, lease = parts
        self._parts.pop(term.token, None)
        results = await asyncio.gather(self.lease.release(lease, timeout=timeout),
                                       self.postgres.release(pg, timeout=timeout), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def observe(self, *, timeout: float) -> LockRecord:
        return await self.postgres.observe(timeout=timeout)

    async def close(self) -> None:
        await asyncio.gather(self.lease.close(), self.postgres.close())
