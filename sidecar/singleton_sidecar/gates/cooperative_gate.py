"""The cooperative gate, for apps that check leadership themselves (the SDK)."""

from __future__ import annotations

import asyncio
import logging

from singleton_election.core.status import ElectionStatus, Role

log = logging.getLogger(__name__)


class CooperativeGate:
    """For apps that check leadership themselves (the SDK): nothing to start or kill, but an
    app that registered as acting for a term (``POST /acting?token=N`` on the control port)
    is waited for until it says it stopped (``POST /stopped?token=N``) before the term is
    released. An app that never registered is not waited for: the sidecar cannot see it, and
    only fenced writes protect what it does after the term ends."""

    def __init__(self) -> None:
        self._status: ElectionStatus | None = None
        self._acting: int | None = None
        self._stopped = asyncio.Event()
        self._stopped.set()

    def __repr__(self) -> str:
        return f"<CooperativeGate acting={self._acting}>"

    @property
    def sees_the_app(self) -> bool:
        """True when an app registered for the current term, so its stop is known."""
        return self._acting is not None and self._status is not None and self._acting == self._status.token

    def on_status(self, status: ElectionStatus) -> None:
        self._status = status

    def on_deadline(self, _deadline: float) -> None:
        return

    def register(self, token: int) -> bool:
        """The app acts for ``token``; False unless that is this replica's acting term."""
        status = self._status
        if status is None or status.role is not Role.LEADER or status.token != token:
            return False
        if self._acting != token:
            self._acting = token
            self._stopped.clear()
        return True

    def acknowledge(self, token: int) -> bool:
        """The app stopped acting for ``token``; False for a token it never registered."""
        if self._acting != token:
            return False
        self._stopped.set()
        return True

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def on_app_container_ended(self) -> None:
        """The pod shows the app's container terminated: an app that died without a
        ``POST /stopped`` acts no more."""
        self._stopped.set()

    async def stop(self, urgent: bool = False) -> None:
        del urgent  # nothing to kill: the app stops by itself
        await self._stopped.wait()

    async def run(self) -> None:
        await asyncio.Event().wait()
