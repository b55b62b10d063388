"""Fakes for unit tests of the election core: a clock on fake time and a scripted lock backend.

``FakeClock`` implements ``singleton_election.core.clock.Clock``. Time moves only when
every task that waits on it has yielded to the loop a number of times in a row with
nothing happening; it then jumps to the earliest pending wake-up (its own, or another
waiter's), so several concurrent waiters (a leader's renew timer and a drain timeout,
or a test that sleeps until a given moment) wake in the order of their deadlines.
With a single waiter this is simply: yield a few times, then advance by ``timeout``.

``FakeBackend`` implements ``singleton_election.core.lock.LockBackend`` from scripts,
one per operation; every call is recorded (with the fake time) in a log that tests can
share with their listeners, and a call the script does not expect fails the test, like
client-go's fake lock.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from singleton_election.core.lock import Identity, LockRecord, LossCallback, Term, Token

# --- fake time --------------------------------------------------------------------------------


class FakeClock:
    """The ``Clock`` protocol on fake time: tests run in milliseconds of real time."""

    def __init__(self, now: float = 1000.0, *, idle_yields: int = 20) -> None:
        self._now = now
        self._epoch = 0  # bumped on every change of time
        self._wake_times: list[float] = []
        self.idle_yields = idle_yields

    @property
    def now(self) -> float:
        return self._now

    @now.setter
    def now(self, value: float) -> None:
        if value != self._now:
            self._now = value
            self._epoch += 1

    def monotonic(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Jump ahead at once, without letting any task run (a paused process)."""
        assert seconds >= 0, "monotonic time never goes backwards"
        self.now = self._now + seconds

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        if event.is_set():
            return True
        wake_at = self._now + max(timeout, 0.0)
        self._wake_times.append(wake_at)
        try:
            while True:
                epoch, idle = self._epoch, 0
                while idle < self.idle_yields:
                    await asyncio.sleep(0)
                    if event.is_set():
                        return True
                    if self._now >= wake_at:
                        return False
                    if self._epoch != epoch:  # time moved: let everyone catch up again
                        epoch, idle = self._epoch, 0
                    else:
                        idle += 1
                # Nothing happened for a while: on to the earliest wake-up of anyone.
                self.now = max(self._now, min(self._wake_times))
                if self._now >= wake_at:
                    return False
        finally:
            self._wake_times.remove(wake_at)

    async def sleep(self, seconds: float) -> None:
        await self.wait(asyncio.Event(), seconds)

    async def sleep_until(self, when: float) -> None:
        """Sleep in fake time until ``when``, letting everything due before then happen."""
        assert when >= self._now, f"cannot sleep back to {when} from {self._now}"
        await self.sleep(when - self._now)


async def settle(condition: Callable[[], bool], *, rounds: int = 10_000) -> None:
    """Yield to the loop until ``condition()`` holds (fake time may move meanwhile)."""
    for _ in range(rounds):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"condition not reached after {rounds} loop rounds: {condition}")


# --- scripted backend ---------------------------------------------------------------------------


class UnexpectedCall(AssertionError):
    """A backend call that the test's script did not expect."""


@dataclass(frozen=True)
class Win:
    """``acquire`` takes the lock with ``token``; ``written_at`` is stamped just before the write,
    which then takes ``write_time`` seconds of fake time."""

    token: int
    version: str = ""
    write_time: float = 0.0
    acting_in: float = 0.0
    """The term may act only this many seconds after it was written (a takeover of an unreleased term)."""


@dataclass(frozen=True)
class Held:
    """``acquire`` waits its whole timeout (the lock stays held) and returns the holder's record."""

    holder: str | None
    token: int | None
    version: str = ""
    wait: bool = True


@dataclass(frozen=True)
class Renewed:
    """``renew`` succeeds: a new version, ``written_at`` stamped just before the write."""

    write_time: float = 0.0


@dataclass(frozen=True)
class Hang:
    """The call takes its whole timeout (plus ``extra``) of fake time, then gives ``then``
    (an exception instance is raised)."""

    then: Any = None
    extra: float = 0.0


@dataclass(frozen=True)
class Delay:
    """The call takes ``seconds`` of fake time, then gives ``then`` (an exception instance is raised)."""

    seconds: float
    then: Any = None


class _Block:
    def __repr__(self) -> str:
        return "BLOCK"


BLOCK: Any = _Block()
"""The call never returns (until its task is cancelled): parks the elector at a known point."""

RENEWED = Renewed()
LOST = None
"""``renew`` reports the term is no longer ours."""
OK = None
"""``release`` succeeded."""


@dataclass(frozen=True)
class Call:
    op: str
    at: float
    term: Term | None = None
    identity: Identity | None = None
    timeout: float | None = None


Step = Any
"""A scripted result: a value of the kinds above, an exception instance (raised), or a callable
``(call) -> step`` (sync or async) whose result is then handled as a step."""


class FakeBackend:
    """A scripted ``LockBackend``. ``log`` is shared with the test: each call is appended as
    ``(fake time, op, token or identity)``."""

    name = "fake"

    def __init__(self, clock: FakeClock, *, log: list[tuple[Any, ...]] | None = None,
                 acquire: Iterable[Step] = (), renew: Iterable[Step] = (), release: Iterable[Step] = (),
                 observe: Iterable[Step] = ()) -> None:
        self.clock = clock
        self.log: list[tuple[Any, ...]] = log if log is not None else []
        self.scripts: dict[str, deque[Step]] = {
            "acquire": deque(acquire), "renew": deque(renew), "release": deque(release), "observe": deque(observe),
        }
        self.calls: list[Call] = []
        self.unexpected: list[str] = []
        self.loss_callback: LossCallback | None = None
        self.lenient_release = False
        """Set at teardown: a release while the elector is cancelled is fine."""
        self.closed = False
        self._versions = 0

    # --- scripting helpers for tests ----------------------------------------------------

    def script(self, op: str, *steps: Step) -> None:
        self.scripts[op].extend(steps)

    def fire_loss(self, reason: str) -> None:
        assert self.loss_callback is not None, "the elector did not register a loss callback"
        self.log.append((self.clock.now, "loss", reason))
        self.loss_callback(reason)

    def ops(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]

    def times(self, op: str) -> list[float]:
        return [c.at for c in self.calls if c.op == op]

    def leftover(self) -> dict[str, list[Step]]:
        """Scripted steps not consumed (BLOCK at the end of a script does not count)."""
        return {op: list(s) for op, s in self.scripts.items() if [x for x in s if x is not BLOCK]}

    # --- LockBackend ---------------------------------------------------------------------

    async def acquire(self, identity: Identity, *, timeout: float) -> Term | LockRecord:
        call = self._record(Call("acquire", self.clock.now, identity=identity, timeout=timeout), identity)
        result = await self._play(call)
        if isinstance(result, Win):
            term = Term(identity=identity, token=Token(result.token), version=result.version or self._version(),
                        written_at=self.clock.now, acting_from=self.clock.now + result.acting_in)
            await self._take(result.write_time)
            return term
        if isinstance(result, Held):
            if result.wait:
                await self.clock.sleep(timeout)
            return LockRecord(holder=None if result.holder is None else Identity(result.holder),
                              token=None if result.token is None else Token(result.token),
                              version=result.version)
        if isinstance(result, Term | LockRecord):
            return result
        raise self._bad(call, result)

    async def renew(self, term: Term, *, timeout: float) -> Term | None:
        call = self._record(Call("renew", self.clock.now, term=term, timeout=timeout), term.token)
        result = await self._play(call)
        if isinstance(result, Renewed):
            renewed = replace(term, version=self._version(), written_at=self.clock.now)
            await self._take(result.write_time)
            return renewed
        if result is None or isinstance(result, Term):
            return result
        raise self._bad(call, result)

    async def release(self, term: Term, *, timeout: float) -> None:
        call = self._record(Call("release", self.clock.now, term=term, timeout=timeout), term.token)
        if self.lenient_release and not self.scripts["release"]:
            return
        result = await self._play(call)
        if result is not None:
            raise self._bad(call, result)

    async def observe(self, *, timeout: float) -> LockRecord:
        call = self._record(Call("observe", self.clock.now, timeout=timeout), None)
        result = await self._play(call)
        if isinstance(result, LockRecord):
            return result
        raise self._bad(call, result)

    def set_loss_callback(self, callback: LossCallback) -> None:
        self.loss_callback = callback

    async def close(self) -> None:
        self.closed = True

    # --- inside ----------------------------------------------------------------------------

    def _record(self, call: Call, detail: object) -> Call:
        self.calls.append(call)
        self.log.append((call.at, call.op, detail))
        return call

    async def _play(self, call: Call) -> Any:
        script = self.scripts[call.op]
        if not script:
            message = f"unexpected {call.op} call at t={call.at:g} ({call}); script exhausted"
            self.unexpected.append(message)
            raise UnexpectedCall(message)
        step = script[0]
        if step is BLOCK:  # stays at the head: every later call blocks too
            await asyncio.Event().wait()
        script.popleft()
        return await self._resolve(step, call)

    async def _resolve(self, step: Step, call: Call) -> Any:
        while True:
            if isinstance(step, BaseException):
                raise step
            if isinstance(step, Hang):
                await self.clock.sleep((call.timeout or 0.0) + step.extra)
                step = step.then
                continue
            if isinstance(step, Delay):
                await self.clock.sleep(step.seconds)
                step = step.then
                continue
            if callable(step) and not isinstance(step, type):
                step = step(call)
                if inspect.isawaitable(step):
                    step = await step
                continue
            return step

    async def _take(self, seconds: float) -> None:
        if seconds > 0:
            await self.clock.sleep(seconds)

    def _version(self) -> str:
        self._versions += 1
        return f"v{self._versions}"

    def _bad(self, call: Call, result: object) -> UnexpectedCall:
        message = f"bad scripted result for {call.op}: {result!r}"
        self.unexpected.append(message)
        return UnexpectedCall(message)
