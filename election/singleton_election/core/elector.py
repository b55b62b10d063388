"""The elector: campaign, lead, renew until the deadline, end the term, release.

Called by the sidecar app (``singleton_sidecar.app``), which gives it a backend, a
clock, listeners and the two app hooks (drain, stop). Rules (invariants S1-S3):
- a leader whose renewal has not succeeded within ``renew_deadline`` of the last good
  write steps down at once, without waiting for the lease to expire;
- a backend that reports the held lock gone (a dropped database connection) makes the
  leader step down at once, also while the acquisition is still in flight;
- every term ends on one path (``core.ending``): publish the new role to every listener
  (readiness, gate, pod annotations) before any I/O; stop the app and wait until it has
  stopped; only then release the lock. Step-down, handover and drain first drain (the
  term stays renewed while the app finishes, up to the drain timeout);
- a term taken over from a holder that did not release (``Term.acting_from``) is held,
  renewed, without acting until that holder's app is surely stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from singleton_election.core.clock import Clock, SystemClock
from singleton_election.core.ending import Action, Decision, LeadState, decide
from singleton_election.core.lock import BackendUnavailable, Identity, LockBackend, LockRecord, Term
from singleton_election.core.status import ElectionStatus, Role
from singleton_election.core.timings import Timings

log = logging.getLogger(__name__)

Listener = Callable[[ElectionStatus], None]
DeadlineListener = Callable[[float], None]
DrainHook = Callable[[bool], Awaitable[None]]
"""Asks the app to finish its in-flight work and returns once it has stopped. Called with
True when the process is going away for good (pod deletion), False for a step-down."""
StopHook = Callable[[bool], Awaitable[None]]
"""Returns once the app has stopped, killing it if it must: after the gate's grace, or at once
when called with True (the lock is already gone)."""
RenewObserver = Callable[[float, bool], None]
StopObserver = Callable[[float, bool], None]
"""Told how long the stop step took, and whether the app was confirmed stopped."""

RELEASE_TIMEOUT = 2.0
"""Seconds a release may take; the lock frees by itself (session end or expiry) after that."""

DRAIN_TIMEOUT_PASSED = "drain timeout passed; stopping the app"
"""The log line of a drain cut short by the drain timeout (tools that read logs count it)."""


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
        stop_hook: StopHook | None = None,
        stop_timeout: float = 5.0,
        on_renew: RenewObserver | None = None,
        on_app_stopped: StopObserver | None = None,
    ) -> None:
        self.group = group
        self.identity = identity
        self.backend = backend
        self.timings = timings
        self.clock: Clock = clock or SystemClock()
        self._wall_clock = wall_clock
        self._drain_hook = drain_hook
        self.drain_timeout = drain_timeout
        self._stop_hook = stop_hook
        self.stop_timeout = stop_timeout
        self._on_renew = on_renew
        self._on_app_stopped = on_app_stopped
        self._listeners: list[Listener] = []
        self._deadline_listeners: list[DeadlineListener] = []
        self._wakeup = asyncio.Event()
        self._drain_requested = asyncio.Event()
        self._released = asyncio.Event()
        self._lost_reason: str | None = None
        self._step_down_reason: str | None = None
        self._hold_until = 0.0
        self._hold_changed = asyncio.Event()
        self._deadline = 0.0
        self._acting_from = 0.0
        self.last_progress = self.clock.monotonic()
        self.unconfirmed_stops = 0
        """Terms whose app was not confirmed stopped within ``stop_timeout`` (left unreleased)."""
        self._status = ElectionStatus(
            group=group, identity=identity, role=Role.STANDBY, term=None, leader=None,
            leader_token=None, leader_since=None, transitions=0, reason="starting",
        )
        backend.set_loss_callback(self._on_lock_lost)

    def __repr__(self) -> str:
        return f"<Elector group={self.group} identity={self.identity} role={self._status.role}>"

    def _fields(self, **more: object) -> dict[str, object]:
        """The fields of this elector's log lines: its group and identity, then ``more``."""
        return {"group": self.group, "identity": self.identity, **more}

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

    def add_deadline_listener(self, listener: DeadlineListener) -> None:
        """Called with the monotonic time until which the term may act, whenever it moves
        (the term begins, each renewal, 0 when the term ends). Gates that carry their own
        deadline (the exec gate's keeper, the file gate's flag) follow it."""
        self._deadline_listeners.append(listener)

    # --- control -----------------------------------------------------------------------

    def request_drain(self) -> None:
        """Stop taking work, let the app finish, release, and campaign no more."""
        if not self._drain_requested.is_set():
            log.info("drain requested", extra=self._fields())
        self._drain_requested.set()
        self._wakeup.set()

    def request_step_down(self, reason: str) -> None:
        """Drain the current term (if any), release it, and campaign again after a lease duration."""
        if self._step_down_reason is None:
            self._step_down_reason = reason
        self._wakeup.set()

    def request_hold(self, seconds: float) -> None:
        """Do not campaign for ``seconds`` (0 ends a hold): a planned handover to another
        candidate holds every other standby off while the leader steps down."""
        self._hold_until = self.clock.monotonic() + max(seconds, 0.0)
        log.info("hold requested", extra=self._fields(hold_seconds=seconds))
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
            if self._status.role is not Role.RELEASED:
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
            # A loss reported from here on belongs to the term this attempt may win.
            self._lost_reason = None
            try:
                result = await self._acquire_unless_held()
            except BackendUnavailable as exc:
                reason = f"lock store unavailable: {exc}"
                if reason != self._status.reason:  # once per outage (and per new error), not per retry
                    log.warning("lock store unavailable", extra=self._fields(error=str(exc)))
                self._note_observed(None, reason)
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
        self._acting_from = term.acting_from
        self._step_down_reason = None
        if self._lost_reason is not None:
            pass  # lost while the acquisition was returning: never act on it
        elif self._acting_from > self.clock.monotonic():
            # Holding, not acting: the previous holder did not release and may still be stopping.
            wait = self._acting_from - self.clock.monotonic()
            self._publish(role=Role.STANDBY, term=None, reason=f"taking over: the previous holder did not "
                          f"release; acting in {wait:.2f}s, once its app is surely stopped")
        else:
            self._begin_acting(term)
        next_renew = term.written_at + timings.retry_period
        drain_task: asyncio.Task[None] | None = None
        decision = Decision(Action.FINISH, "stopped while leading", Role.STANDBY)
        try:
            while True:
                now = self.clock.monotonic()
                self.last_progress = now
                decision = decide(LeadState(
                    now=now, deadline=self._deadline, lost_reason=self._lost_reason,
                    drain_requested=self._drain_requested.is_set(), step_down_reason=self._step_down_reason,
                    draining=drain_task is not None, drain_done=drain_task is not None and drain_task.done(),
                ), timings)
                if decision.action is Action.FINISH:
                    break
                if self._status.role is Role.STANDBY:  # a takeover, not acting yet
                    if decision.action is Action.DRAIN:
                        decision = self._end_before_acting(decision)
                        break
                    if now >= self._acting_from:
                        self._begin_acting(term)
                if decision.action is Action.DRAIN:
                    self._publish(role=Role.DRAINING, term=term, reason=decision.reason)
                    drain_task = asyncio.create_task(self._drain(final=self._drain_requested.is_set()),
                                                     name=f"drain:{self.group}")
                    drain_task.add_done_callback(lambda _t: self._wakeup.set())
                term, next_renew = await self._wait_or_renew(term, now, next_renew)
        finally:
            if decision.action is not Action.FINISH:  # cancelled mid-term
                decision = Decision(Action.FINISH, "stopped while leading", Role.STANDBY)
            pause = await self._finish(term, decision, drain_task)
        await self.clock.wait(self._drain_requested, pause)

    def _end_before_acting(self, decision: Decision) -> Decision:
        """Asked to end a term that has not begun acting: nothing to drain."""
        then = Role.RELEASED if self._drain_requested.is_set() else Role.STANDBY
        return Decision(Action.FINISH, decision.reason.replace("stepping down", "stepped down"), then,
                        self.timings.lease_duration)

    async def _wait_or_renew(self, term: Term, now: float, next_renew: float) -> tuple[Term, float]:
        """Sleep until the next thing due (renewal, deadline, the end of a takeover wait, a
        wake-up), or renew if it is due. Returns the term and the next renewal time."""
        wake_at = min(next_renew, self._deadline)
        if self._acting_from > now:
            wake_at = min(wake_at, self._acting_from)
        if now < wake_at:
            self._wakeup.clear()
            await self.clock.wait(self._wakeup, wake_at - now)
            return term, next_renew
        if now < next_renew:
            return term, next_renew
        renewed, next_renew = await self._renew(term, now)
        if renewed is None:
            self._lost_reason = "lost the lock: another candidate holds it"
            return term, next_renew
        return renewed, next_renew

    def _begin_acting(self, term: Term) -> None:
        self._publish(role=Role.LEADER, term=term, leader_since=self._wall_clock(), reason="acquired the lock")
        self._tell_deadline(self._deadline)

    async def _finish(self, term: Term, decision: Decision, drain_task: asyncio.Task[None] | None) -> float:
        """The one end of every term: publish, stop the app, release. Returns the pause
        before campaigning again."""
        was_acting = self._status.role in (Role.LEADER, Role.DRAINING)
        self._publish(role=decision.then, term=None, reason=decision.reason)
        self._tell_deadline(0.0)
        if drain_task is not None and not drain_task.done():
            drain_task.cancel()
            await asyncio.gather(drain_task, return_exceptions=True)
        if decision.then is Role.STANDBY:
            log.warning("stepped down", extra=self._fields(token=term.token, reason=decision.reason))
        if not was_acting or await self._stop_app(urgent=decision.urgent):
            await self._release(term, decision.reason)
            return decision.pause
        # Never release while the app may still act: the lock frees by itself at expiry.
        self.unconfirmed_stops += 1
        log.error("app not confirmed stopped: not releasing; the lock frees by itself when its lease expires",
                  extra=self._fields(token=term.token, stop_timeout_seconds=self.stop_timeout))
        return max(decision.pause, self.timings.lease_duration)

    async def _stop_app(self, *, urgent: bool) -> bool:
        """Wait (bounded) until the app has stopped; True once it has."""
        if self._stop_hook is None:
            return True
        started = self.clock.monotonic()
        stopping = asyncio.ensure_future(self._stop_hook(urgent))
        finished = asyncio.Event()
        stopping.add_done_callback(lambda _t: finished.set())
        try:
            await self.clock.wait(finished, self.stop_timeout)
        finally:
            if not stopping.done():
                stopping.cancel()
            (outcome,) = await asyncio.gather(stopping, return_exceptions=True)
        seconds = self.clock.monotonic() - started
        confirmed = finished.is_set() and not isinstance(outcome, BaseException)
        if self._on_app_stopped is not None:
            self._on_app_stopped(seconds, confirmed)
        if not confirmed:
            if isinstance(outcome, Exception):
                log.error("stopping the app failed", extra=self._fields(), exc_info=outcome)
            return False
        log.info("app stopped", extra=self._fields(duration_seconds=round(seconds, 3)))
        return True

    async def _renew(self, term: Term, now: float) -> tuple[Term | None, float]:
        """One renewal attempt. Returns (new term or None if lost, next renewal time)."""
        timings = self.timings
        started = self.clock.monotonic()
        try:
            renewed = await self.backend.renew(term, timeout=max(self._deadline - now, 0.001))
        except BackendUnavailable as exc:
            self._observe_renew(started, ok=False)
            log.warning("renewal failed", extra=self._fields(token=term.token, error=exc))
            # Retry soon: the deadline, not the retry period, bounds how long we keep trying.
            return term, self.clock.monotonic() + min(timings.retry_period / 4, 0.25)
        self._observe_renew(started, ok=renewed is not None)
        if renewed is None:
            return None, now
        self._deadline = renewed.written_at + timings.renew_deadline
        if self._status.term is not None:
            self._status = replace(self._status, term=renewed)
            self._tell_deadline(self._deadline)
        log.debug("renewed", extra=self._fields(token=renewed.token))
        return renewed, renewed.written_at + timings.retry_period

    def _observe_renew(self, started: float, *, ok: bool) -> None:
        if self._on_renew is not None:
            self._on_renew(self.clock.monotonic() - started, ok)

    def _tell_deadline(self, deadline: float) -> None:
        for listener in list(self._deadline_listeners):
            try:
                listener(deadline)
            except Exception:
                log.exception("deadline listener %r failed", listener, extra=self._fields())

    async def _drain(self, *, final: bool) -> None:
        if self._drain_hook is None:
            return
        # Timed on the injected clock, like every other deadline of the core.
        try:
            hook = asyncio.ensure_future(self._drain_hook(final))
        except Exception:
            log.exception("drain hook failed", extra=self._fields())
            return
        finished = asyncio.Event()
        hook.add_done_callback(lambda _t: finished.set())
        try:
            if not await self.clock.wait(finished, self.drain_timeout):
                log.warning(DRAIN_TIMEOUT_PASSED,
                            extra=self._fields(drain_timeout_seconds=self.drain_timeout))
        finally:
            hook.cancel()
            (outcome,) = await asyncio.gather(hook, return_exceptions=True)
        if isinstance(outcome, Exception):
            log.error("drain hook failed; stopping the app", extra=self._fields(), exc_info=outcome)

    async def _release(self, term: Term, reason: str) -> None:
        try:
            await self.backend.release(term, timeout=RELEASE_TIMEOUT)
            log.info("released", extra=self._fields(token=term.token, reason=reason))
        except BackendUnavailable as exc:
            log.warning("release failed (the lock frees by itself)", extra=self._fields(token=term.token, error=exc))

    def _on_lock_lost(self, reason: str) -> None:
        # Recorded whatever the role: a loss may arrive while the acquisition that won the
        # term is still returning; ``_campaign`` clears it before each attempt.
        self._lost_reason = f"lock lost: {reason}"
        if self._status.role in (Role.LEADER, Role.DRAINING):
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
            log.info("role %s -> %s", old.role, role,
                     extra=self._fields(role=role, previous_role=old.role, token=new.token, reason=reason))
        for listener in list(self._listeners):
            try:
                listener(new)
            except Exception:
                log.exception("election listener %r failed", listener, extra=self._fields())
