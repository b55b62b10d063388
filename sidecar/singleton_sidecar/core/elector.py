"""The elector: campaign, lead, renew until the deadline, drain, release.

Called by the sidecar app (``singleton_sidecar.app``), which gives it a backend, a
clock and listeners. Rules (DESIGN.md, invariants S1-S3):
- a leader whose renewal has not succeeded within ``renew_deadline`` of the last good
  write steps down at once, without waiting for the lease to expire;
- a backend that reports the held lock gone (a dropped database connection) makes the
  leader step down at once;
- stepping down publishes the new role to every listener (readiness, gate, pod
  annotations) BEFORE any I/O, and only then tries to release the lock;
- draining keeps the term renewed until the drain hook returns or the drain timeout
  passes, and only then releases, in a ``finally`` that cannot be skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from singleton_sidecar.core.clock import Clock, SystemClock
from singleton_sidecar.core.lock import BackendUnavailable, Identity, LockBackend, LockRecord, Term
from singleton_sidecar.core.status import ElectionStatus, Role
from singleton_sidecar.core.timings import Timings

log = logging.getLogger(__name__)

Listener = Callable[[ElectionStatus], None]
DrainHook = Callable[[], Awaitable[None]]
RenewObserver = Callable[[float, bool], None]

RELEASE_TIMEOUT = 2.0
"""Seconds a release may take; the lock frees by itself (session end or expiry) after that."""


class Elector:
    def __init__(
        self,
        *,
        group: str,
        identity: Identity,
        backend: LockBackend,
        timings: Timings,
        clock: Clock | None = None,
        wall_clock: Callable[[], float],
        drain_hook: DrainHook | None = None,
        drain_timeout: float = 30.0,
        on_renew: RenewObserver | None = None,
    ) -> None:
        self.group = group
        self.identity = identity
        self.backend = backend
        self.timings = timings
        self.clock: Clock = clock or SystemClock()
        self._wall_clock = wall_clock
        self._drain_hook = drain_hook
        self.drain_timeout = drain_timeout
        self._on_renew = on_renew
        self._listeners: list[Listener] = []
        self._wakeup = asyncio.Event()
        self._drain_requested = asyncio.Event()
        self._released = asyncio.Event()
        self._lost_reason: str | None = None
        self._step_down_reason: str | None = None
        self._hold_until = 0.0
        self._hold_changed = asyncio.Event()
        self._deadline = 0.0
        self.last_progress = self.clock.monotonic()
        self._status = ElectionStatus(
            group=group, identity=identity, role=Role.STANDBY, term=None, leader=None,
            leader_token=None, leader_since=None, transitions=0, reason="starting",
        )
        backend.set_loss_callback(self._on_lock_lost)

    def __repr__(self) -> str:
        return f"<Elector group={self.group} identity={self.identity} role={self._status.role}>"

    # --- what others read --------------------------------------------------------------

    @property
    def status(self) -> ElectionStatus:
        return self._status

    def acting_term(self) -> Term | None:
        """The term if this candidate may act now: leading or draining, and inside its
        renew deadline by the clock at this very moment (so a process that was paused
        past its deadline answers "no" before the loop has even run again)."""
        status = self._status
        if status.role not in (Role.LEADER, Role.DRAINING) or status.term is None:
            return None
        if self.clock.monotonic() >= self._deadline:
            return None
        return status.term

    def remaining(self) -> float:
        """Seconds this candidate may still act without another successful renewal (0: none)."""
        if self.acting_term() is None:
            return 0.0
        return max(self._deadline - self.clock.monotonic(), 0.0)

    def is_ready_leader(self) -> bool:
        """Leader, not draining, inside the renew deadline: what /readyz answers."""
        return self._status.role is Role.LEADER and self.acting_term() is not None

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    # --- control -----------------------------------------------------------------------

    def request_drain(self) -> None:
        """Stop taking work, let the app finish, release, and campaign no more."""
        if not self._drain_requested.is_set():
            log.info("drain requested group=%s identity=%s", self.group, self.identity)
        self._drain_requested.set()
        self._wakeup.set()

    def request_step_down(self, reason: str) -> None:
        """Release the current term (if any) and campaign again after a lease duration."""
        self._step_down_reason = reason
        self._wakeup.set()

    def request_hold(self, seconds: float) -> None:
        """Do not campaign for ``seconds`` (0 ends a hold): a planned handover to another
        candidate holds every other standby off while the leader steps down."""
        self._hold_until = self.clock.monotonic() + max(seconds, 0.0)
        log.info("hold requested group=%s identity=%s seconds=%g", self.group, self.identity, seconds)
        self._hold_changed.set()

    def _holding(self) -> float:
        return max(self._hold_until - self.clock.monotonic(), 0.0)

    async def wait_released(self) -> None:
        await self._released.wait()

    # --- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign and lead until drained (or cancelled). Reads like the specification."""
        try:
            while not self._drain_requested.is_set():
                term = await self._campaign()
                if term is None:
                    break
                await self._lead(term)
        finally:
            self._publish(role=Role.RELEASED, term=None, reason="released: no longer campaigning")
            self._released.set()

    async def _campaign(self) -> Term | None:
        self._publish(role=Role.STANDBY, term=None, reason=self._status.reason)
        while not self._drain_requested.is_set():
            self.last_progress = self.clock.monotonic()
            hold = self._holding()
            if hold > 0:
                self._note_observed(None, f"holding off for {hold:.1f}s: a handover to another candidate")
                self._hold_changed.clear()
                await self.clock.wait(self._hold_changed, min(hold, self.timings.retry_period))
                continue
            try:
                result = await self._acquire_unless_held()
            except BackendUnavailable as exc:
                self._note_observed(None, f"lock store unavailable: {exc}")
                await self.clock.wait(self._drain_requested, self.timings.retry_period)
                continue
            if isinstance(result, Term):
                if self._drain_requested.is_set():
                    await self._release(result, "acquired while draining")
                    return None
                if self._holding() > 0:
                    # The hold came while the lock was being granted: let the chosen one have it.
                    await self._release(result, "acquired during a hold")
                    continue
                return result
            if result is None:
                continue
            self._note_observed(result, "standing by")
        return None

    async def _acquire_unless_held(self) -> Term | LockRecord | None:
        """One acquisition attempt, abandoned (None) if a hold is requested meanwhile."""
        self._hold_changed.clear()
        attempt = asyncio.ensure_future(self.backend.acquire(self.identity, timeout=self.timings.retry_period))
        held = asyncio.ensure_future(self._hold_changed.wait())
        try:
            await asyncio.wait({attempt, held}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await self._abandon(attempt)
            raise
        finally:
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
        if attempt.done() or self._holding() <= 0:
            return await attempt
        await self._abandon(attempt)
        return None

    async def _abandon(self, attempt: asyncio.Future[Term | LockRecord]) -> None:
        """Cancel an acquisition; if it had already won, give the lock back."""
        attempt.cancel()
        (result,) = await asyncio.gather(attempt, return_exceptions=True)
        if isinstance(result, Term):
            await asyncio.shield(self._release(result, "acquisition abandoned"))

    async def _lead(self, term: Term) -> None:
        timings = self.timings
        self._deadline = term.written_at + timings.renew_deadline
        self._lost_reason = None
        self._step_down_reason = None
        self._publish(role=Role.LEADER, term=term, leader_since=self._wall_clock(), reason="acquired the lock")
        next_renew = term.written_at + timings.retry_period
        drain_task: asyncio.Task[None] | None = None
        released = False
        try:
            while True:
                now = self.clock.monotonic()
                self.last_progress = now
                reason = self._why_stop(now)
                if reason is not None:
                    break
                if self._drain_requested.is_set() and drain_task is None:
                    self._publish(role=Role.DRAINING, term=term, reason="draining: finishing in-flight work")
                    drain_task = asyncio.create_task(self._drain(), name=f"drain:{self.group}")
                    drain_task.add_done_callback(lambda _t: self._wakeup.set())
                if drain_task is not None and drain_task.done():
                    # Stop acting (gate, /leader, annotations) before the lock can pass on.
                    self._publish(role=Role.RELEASED, term=None, reason="released: no longer campaigning")
                    await self._release(term, "drained")
                    released = True
                    return
                if self._step_down_reason is not None:
                    # Publish first, release second, as on every step-down.
                    self._publish(role=Role.STANDBY, term=None, reason=f"stepped down: {self._step_down_reason}")
                    await self._release(term, self._step_down_reason)
                    released = True
                    await self.clock.wait(self._drain_requested, timings.lease_duration)
                    return
                if now < next_renew:
                    self._wakeup.clear()
                    await self.clock.wait(self._wakeup, min(next_renew, self._deadline) - now)
                    continue
                renewed, next_renew = await self._renew(term, now)
                if renewed is None:
                    reason = "lost the lock: another candidate holds it"
                    break
                term = renewed
            # Step down: publish first (gate closes, readiness drops), then release.
            self._publish(role=Role.STANDBY, term=None, reason=f"stepped down: {reason}")
            log.warning("stepped down group=%s identity=%s token=%s reason=%s",
                        self.group, self.identity, term.token, reason)
            await self._release(term, reason)
            released = True
            await self.clock.wait(self._drain_requested, timings.retry_period)
        finally:
            if drain_task is not None and not drain_task.done():
                drain_task.cancel()
                await asyncio.gather(drain_task, return_exceptions=True)
            if not released:
                # Cancelled mid-term: stop acting first, then free the lock.
                self._publish(role=Role.STANDBY, term=None, reason="stopped while leading")
                await self._release(term, "stopped while leading")

    def _why_stop(self, now: float) -> str | None:
        if self._lost_reason is not None:
            return self._lost_reason
        if now >= self._deadline:
            return f"no successful renewal within renew_deadline ({self.timings.renew_deadline:g}s)"
        return None

    async def _renew(self, term: Term, now: float) -> tuple[Term | None, float]:
        """One renewal attempt. Returns (new term or None if lost, next renewal time)."""
        timings = self.timings
        started = self.clock.monotonic()
        try:
            renewed = await self.backend.renew(term, timeout=max(self._deadline - now, 0.001))
        except BackendUnavailable as exc:
            self._observe_renew(started, ok=False)
            log.warning("renewal failed group=%s identity=%s token=%s error=%s",
                        self.group, self.identity, term.token, exc)
            # Retry soon: the deadline, not the retry period, bounds how long we keep trying.
            return term, self.clock.monotonic() + min(timings.retry_period / 4, 0.25)
        self._observe_renew(started, ok=renewed is not None)
        if renewed is None:
            return None, now
        self._deadline = renewed.written_at + timings.renew_deadline
        self._status = replace(self._status, term=renewed)
        log.debug("renewed group=%s identity=%s token=%s", self.group, self.identity, renewed.token)
        return renewed, renewed.written_at + timings.retry_period

    def _observe_renew(self, started: float, *, ok: bool) -> None:
        if self._on_renew is not None:
            self._on_renew(self.clock.monotonic() - started, ok)

    async def _drain(self) -> None:
        if self._drain_hook is None:
            return
        # Timed on the injected clock, like every other deadline of the core.
        try:
            hook = asyncio.ensure_future(self._drain_hook())
        except Exception:
            log.exception("drain hook failed group=%s identity=%s; releasing", self.group, self.identity)
            return
        finished = asyncio.Event()
        hook.add_done_callback(lambda _t: finished.set())
        try:
            if not await self.clock.wait(finished, self.drain_timeout):
                log.warning("drain timeout (%gs) passed group=%s identity=%s; releasing anyway",
                            self.drain_timeout, self.group, self.identity)
        finally:
            hook.cancel()
            (outcome,) = await asyncio.gather(hook, return_exceptions=True)
        if isinstance(outcome, Exception):
            log.error("drain hook failed group=%s identity=%s; releasing", self.group, self.identity,
                      exc_info=outcome)

    async def _release(self, term: Term, reason: str) -> None:
        try:
            await self.backend.release(term, timeout=RELEASE_TIMEOUT)
            log.info("released group=%s identity=%s token=%s reason=%s",
                     self.group, self.identity, term.token, reason)
        except BackendUnavailable as exc:
            log.warning("release failed group=%s identity=%s token=%s error=%s (the lock frees by itself)",
                        self.group, self.identity, term.token, exc)

    def _on_lock_lost(self, reason: str) -> None:
        if self._status.role in (Role.LEADER, Role.DRAINING):
            self._lost_reason = f"lock lost: {reason}"
            # Stop acting now, not when the loop next runs.
            self._deadline = self.clock.monotonic()
            self._wakeup.set()

    # --- publishing --------------------------------------------------------------------

    def _note_observed(self, record: LockRecord | None, reason: str) -> None:
        old = self._status
        if record is not None and (record.holder, record.token) != (old.leader, old.leader_token):
            self._publish(role=Role.STANDBY, term=None, observed=record, reason=reason)
        elif reason != old.reason:
            self._publish(role=Role.STANDBY, term=None, reason=reason)

    def _publish(self, *, role: Role, term: Term | None, reason: str, observed: LockRecord | None = None,
                 leader_since: float | None = None) -> None:
        old = self._status
        leader: Identity | None
        if role in (Role.LEADER, Role.DRAINING):
            leader, token = self.identity, (term.token if term is not None else None)
            since = leader_since if leader_since is not None else old.leader_since
        elif observed is not None:
            leader, token, since = observed.holder, observed.token, None
        elif old.leader == self.identity:
            leader, token, since = None, None, None
        else:
            leader, token, since = old.leader, old.leader_token, None
        new = ElectionStatus(
            group=self.group, identity=self.identity, role=role, term=term, leader=leader, leader_token=token,
            leader_since=since, transitions=old.transitions + (role != old.role), reason=reason,
        )
        if new == old:
            return
        self._status = new
        if role != old.role:
            log.info("role %s -> %s group=%s identity=%s token=%s reason=%s", old.role, role, self.group,
                     self.identity, new.token, reason)
        for listener in list(self._listeners):
            try:
                listener(new)
            except Exception:
                log.exception("election listener %r failed group=%s", listener, self.group)
