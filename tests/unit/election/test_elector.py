"""Unit tests of the election core on fake time: timings, identities and every elector transition.

Each elector scenario scripts the backend call by call (an unexpected call fails the test)
and checks the trace: backend calls, loss callbacks, drain-hook steps and every status a
listener saw, each with its fake time in seconds after the start (``T0``). Traces read
like ``"2 renew 7"`` (at t=2 a renewal of the term with token 7) or ``"2 publish standby"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from singleton_election.core.elector import RELEASE_TIMEOUT, Elector
from singleton_election.core.ending import Action, Decision, LeadState, decide
from singleton_election.core.identity import is_predecessor, make_identity, pod_of, pod_prefix, validate_identity
from singleton_election.core.lock import BackendUnavailable, Identity, Term
from singleton_election.core.status import ElectionStatus, Role
from singleton_election.core.timings import JITTER_FACTOR, MIN_CLOCK_MARGIN, TimingError, Timings
from tests.support.fakes import (
    BLOCK,
    LOST,
    OK,
    RENEWED,
    Delay,
    FakeBackend,
    FakeClock,
    Hang,
    Held,
    Renewed,
    Win,
    settle,
)

T0 = 1000.0
WALL0 = 1_700_000_000.0
ME = Identity("web-0/0f1e2d3c/cafe0001")
OTHER = "web-1/5a6b7c8d/beef0002"
THIRD = "web-2/9e8f7a6b/f00d0003"
DEFAULT = Timings()
FAST = Timings(lease_duration=1.5, renew_deadline=1.0, retry_period=0.5)


def down(message: str = "connection refused") -> BackendUnavailable:
    return BackendUnavailable(message)


class Rig:
    """One elector on a fake clock and a scripted backend, with a shared trace."""

    def __init__(self, *, timings: Timings = DEFAULT, acquire: list[Any] | None = None,
                 renew: list[Any] | None = None, release: list[Any] | None = None,
                 drain_hook: Callable[[Rig], Callable[[bool], Awaitable[None]]] | None = None,
                 drain_timeout: float = 30.0,
                 stop_hook: Callable[[Rig], Callable[[bool], Awaitable[None]]] | None = None,
                 stop_timeout: float = 3.0) -> None:
        self.clock = FakeClock(T0)
        self.log: list[tuple[Any, ...]] = []
        self.backend = FakeBackend(self.clock, log=self.log, acquire=acquire or [], renew=renew or [],
                                   release=release or [])
        self.statuses: list[ElectionStatus] = []
        self.renewals: list[tuple[float, bool]] = []
        self.elector = Elector(
            group="g", identity=ME, backend=self.backend, timings=timings, clock=self.clock,
            wall_clock=lambda: WALL0 + self.clock.now, drain_hook=drain_hook(self) if drain_hook else None,
            drain_timeout=drain_timeout, stop_hook=stop_hook(self) if stop_hook else None, stop_timeout=stop_timeout,
            on_renew=lambda seconds, ok: self.renewals.append((seconds, ok)),
        )
        self.elector.add_listener(self._on_status)
        self.task: asyncio.Task[None] | None = None

    def _on_status(self, status: ElectionStatus) -> None:
        self.statuses.append(status)
        self.log.append((self.clock.now, "publish", f"{status.role}#{status.token}" if status.token else status.role))

    def note(self, what: str, detail: object = None) -> None:
        self.log.append((self.clock.now, what, detail))

    def trace(self) -> list[str]:
        lines = []
        for at, op, detail in self.log:
            line = f"{at - T0:g} {op}"
            if op != "acquire" and detail is not None:
                line += f" {detail}"
            lines.append(line)
        return lines

    @property
    def now(self) -> float:
        return self.clock.now - T0

    async def until(self, t: float) -> None:
        """Let fake time run until ``t`` seconds after the start."""
        await self.clock.sleep_until(T0 + t)

    async def until_trace(self, line: str) -> None:
        await settle(lambda: line in self.trace())

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[asyncio.Task[None]]:
        """Run the elector in a task; always cancel and await it, then check the backend saw
        only expected calls."""
        self.task = asyncio.create_task(self.elector.run(), name="elector-under-test")
        try:
            yield self.task
        finally:
            self.backend.lenient_release = True  # cancelling a leader releases its term
            self.task.cancel()
            (outcome,) = await asyncio.gather(self.task, return_exceptions=True)
        assert not self.backend.unexpected, self.backend.unexpected
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            raise outcome
        assert not self.backend.leftover(), f"scripted calls never made: {self.backend.leftover()}"


def leading(rig: Rig) -> bool:
    return rig.elector.status.role is Role.LEADER


# --- timings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "stop_margin"),
    [
        pytest.param({}, 2.0, id="defaults"),
        pytest.param({"lease_duration": 6, "renew_deadline": 4, "retry_period": 2}, 2.0, id="integers"),
        pytest.param({"lease_duration": 4.5}, MIN_CLOCK_MARGIN, id="margin exactly MIN_CLOCK_MARGIN"),
        pytest.param({"lease_duration": 3.0, "renew_deadline": 2.5, "retry_period": 2.0}, 0.5,
                     id="renew_deadline just above 1.2 x retry_period"),
        pytest.param({"lease_duration": 1.5, "renew_deadline": 1.0, "retry_period": 0.5}, 0.5, id="fast group"),
        pytest.param({"lease_duration": 60.0, "renew_deadline": 40.0, "retry_period": 1.0}, 20.0, id="slow group"),
    ],
)
def test_timings_valid(kwargs: dict[str, float], stop_margin: float) -> None:
    timings = Timings(**kwargs)
    assert timings.stop_margin == stop_margin
    assert timings.lease_duration > timings.renew_deadline > JITTER_FACTOR * timings.retry_period


NAN = math.nan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"lease_duration": 0}, "lease_duration (0s): must be a positive number of seconds",
                     id="lease zero"),
        pytest.param({"renew_deadline": -1.0}, "renew_deadline (-1s): must be a positive number of seconds",
                     id="renew_deadline negative"),
        pytest.param({"retry_period": 0.0}, "retry_period (0s): must be a positive number of seconds",
                     id="retry zero"),
        pytest.param({"retry_period": "2"}, "retry_period ('2'): must be a positive number of seconds",
                     id="retry a string"),
        pytest.param({"lease_duration": None}, "lease_duration (None): must be a positive number", id="lease None"),
        pytest.param({"lease_duration": 4.4}, "renew_deadline (4s): must be at least 0.5s shorter than "
                     "lease_duration (4.4s)", id="margin just below MIN_CLOCK_MARGIN"),
        pytest.param({"lease_duration": 4.0}, "renew_deadline (4s): must be shorter than lease_duration (4s)",
                     id="lease equals renew_deadline"),
        pytest.param({"lease_duration": 3.0}, "renew_deadline (4s): must be shorter than lease_duration (3s)",
                     id="lease below renew_deadline"),
        pytest.param({"lease_duration": 3.0, "renew_deadline": 2.4, "retry_period": 2.0},
                     "renew_deadline (2.4s): must be more than 1.2 times retry_period (2s)",
                     id="renew_deadline exactly 1.2 x retry_period"),
        pytest.param({"lease_duration": 1.0, "renew_deadline": 0.12, "retry_period": 0.1},
                     "renew_deadline (0.12s): must be more than 1.2 times retry_period (0.1s)",
                     id="renew_deadline exactly 1.2 x retry_period, small"),
        pytest.param({"renew_deadline": 4.0, "retry_period": 4.0},
                     "retry_period (4s): must be shorter than renew_deadline (4s)",
                     id="renew_deadline equals retry_period"),
        pytest.param({"retry_period": 5.0}, "retry_period (5s): must be shorter than renew_deadline (4s)",
                     id="retry_period above renew_deadline"),
        pytest.param({"lease_duration": 1.0, "renew_deadline": 0.2, "retry_period": 0.09},
                     "retry_period (0.09s): must be at least 0.1s", id="retry_period under 100ms, as the CRD"),
        pytest.param({"lease_duration": 300.001, "renew_deadline": 4.0}, "lease_duration (300.001s): must be at most "
                     "300s", id="lease_duration over 5m, as the CRD"),
        pytest.param({"lease_duration": NAN}, "lease_duration", id="lease NaN"),
        pytest.param({"renew_deadline": NAN}, "renew_deadline", id="renew_deadline NaN"),
        pytest.param({"retry_period": NAN}, "retry_period", id="retry NaN"),
    ],
)
def test_timings_invalid_names_the_field(kwargs: dict[str, Any], message: str) -> None:
    try:
        Timings(**kwargs)
    except TimingError as exc:
        assert message in str(exc)
        assert isinstance(exc, ValueError)
    else:
        pytest.fail(f"Timings({kwargs}) was accepted")


# --- identities ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param({"pod_name": "web-0", "pod_uid": "0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"},
                     "web-0/0f1e2d3c/abcd1234", id="pod"),
        pytest.param({"pod_name": "web-0", "pod_uid": "01-23-45-67-89ab"}, "web-0/01234567/abcd1234",
                     id="pod uid dashes dropped before the cut"),
        pytest.param({"pod_name": "web-0", "pod_uid": None}, "web-0/nouid/abcd1234", id="pod without uid"),
        pytest.param({"pod_name": None, "pod_uid": None}, "node-1/42/abcd1234", id="host"),
        pytest.param({"pod_name": "", "pod_uid": "0f1e2d3c"}, "node-1/42/abcd1234", id="empty pod name is host"),
    ],
)
def test_make_identity_forms(kwargs: dict[str, Any], expected: str) -> None:
    identity = make_identity(**kwargs, hostname="node-1", pid=42, nonce="abcd1234")
    assert identity == expected
    assert validate_identity(identity) == identity
    assert pod_of(identity) == expected.split("/", maxsplit=1)[0]


@pytest.mark.parametrize("pod_name", [pytest.param("web-0", id="pod"), pytest.param(None, id="host")])
def test_make_identity_fresh_nonce_each_call(pod_name: str | None) -> None:
    identities = [make_identity(pod_name=pod_name, pod_uid="0f1e2d3c", hostname="node-1", pid=42)
                  for _ in range(20)]
    assert len(set(identities)) == len(identities)
    prefix = "web-0/0f1e2d3c/" if pod_name else "node-1/42/"
    for identity in identities:
        assert identity.startswith(prefix)
        assert re.fullmatch(r"[0-9a-f]{8}", identity.removeprefix(prefix))
        assert validate_identity(identity) == identity


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("a", id="one char"),
        pytest.param("a" * 252, id="252 chars"),
        pytest.param("web-0/0f1e2d3c/abcd1234", id="pod form"),
        pytest.param("host.example.com/42/ff", id="host form"),
        pytest.param("0:x_y.z-w", id="every allowed punctuation"),
    ],
)
def test_validate_identity_accepts(value: str) -> None:
    assert validate_identity(value) == value


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("", id="empty"),
        pytest.param("a" * 253, id="253 chars"),
        pytest.param("-web", id="leading dash"),
        pytest.param("/web", id="leading slash"),
        pytest.param(".web", id="leading dot"),
        pytest.param("web 0", id="space"),
        pytest.param("web\t0", id="tab"),
        pytest.param("web\n0", id="inner newline"),
        pytest.param("wéb", id="non-ascii"),
        pytest.param("web;0", id="semicolon"),
        pytest.param("web=0", id="equals"),
        pytest.param("web-0\n", id="trailing newline"),
    ],
)
def test_validate_identity_rejects(value: str) -> None:
    with pytest.raises(ValueError, match="identity must be"):
        validate_identity(value)


# --- standby -> leader ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("acquire", "won_at", "written_at", "trace"),
    [
        pytest.param([Win(7)], 0, 0, ["0 acquire", "0 publish leader#7"], id="free lock"),
        pytest.param([Held(OTHER, 6), Win(7)], 2, 2,
                     ["0 acquire", "2 publish standby", "2 acquire", "2 publish leader#7"],
                     id="held by another, then free"),
        pytest.param([down(), Win(7)], 2, 2,
                     ["0 acquire", "0 publish standby", "2 acquire", "2 publish leader#7"],
                     id="store down, then free"),
        pytest.param([Win(7, write_time=0.5)], 0.5, 0, ["0 acquire", "0.5 publish leader#7"],
                     id="slow write: deadline counts from before the write"),
    ],
)
async def test_standby_becomes_leader(acquire: list[Any], won_at: float, written_at: float,
                                      trace: list[str]) -> None:
    rig = Rig(acquire=acquire, renew=[BLOCK])
    assert rig.elector.status.role is Role.STANDBY
    assert rig.elector.acting_term() is None
    async with rig.running():
        await settle(lambda: leading(rig))
        status = rig.elector.status
        assert rig.now == won_at
        assert rig.trace() == trace
        assert status.role is Role.LEADER
        assert status.term is not None and status.term.token == 7 and status.term.identity == ME
        assert status.term.written_at == T0 + written_at
        assert (status.leader, status.leader_token, status.token) == (ME, 7, 7)
        assert status.leader_since == WALL0 + T0 + won_at
        assert status.reason == "acquired the lock"
        assert status.transitions == 1
        assert rig.elector.acting_term() == status.term
        assert rig.elector.is_ready_leader()
        # The first renewal is due a retry period after the write, not after the publish.
        await rig.until_trace(f"{written_at + 2:g} renew 7")
        assert rig.backend.ops("renew")[0].timeout == pytest.approx(DEFAULT.renew_deadline - 2)


@pytest.mark.parametrize(
    ("timings", "renew", "renew_times"),
    [
        pytest.param(DEFAULT, [RENEWED] * 4, [2, 4, 6, 8], id="default timings"),
        pytest.param(FAST, [RENEWED] * 4, [0.5, 1, 1.5, 2], id="fast timings"),
        pytest.param(DEFAULT, [Renewed(write_time=0.5)] * 4, [2, 4, 6, 8],
                     id="slow writes: cadence counts from written_at"),
    ],
)
async def test_leader_renews_every_retry_period(timings: Timings, renew: list[Any], renew_times: list[float]) -> None:
    rig = Rig(timings=timings, acquire=[Win(7)], renew=[*renew, BLOCK])
    async with rig.running():
        last = renew_times[-1]
        # The last renewal blocks (parks the loop): every one before it extended the deadline.
        await rig.until_trace(f"{last + timings.retry_period:g} renew 7")
        assert [t - T0 for t in rig.backend.times("renew")] == [*renew_times, last + timings.retry_period]
        term = rig.elector.acting_term()
        assert term is not None and term.token == 7 and term.written_at == T0 + last
        assert term.version == rig.backend.ops("renew")[-1].term.version  # type: ignore[union-attr]
        assert rig.elector.status.transitions == 1
        assert [s.role for s in rig.statuses] == [Role.LEADER]
        assert rig.renewals == [(renew[0].write_time, True)] * len(renew_times)  # exact on fake time
        # The blocked renewal cannot extend the term: it stops acting at last + renew_deadline.
        await rig.until(last + timings.renew_deadline - 0.125)
        assert rig.elector.acting_term() == term
        await rig.until(last + timings.renew_deadline)
        assert rig.elector.acting_term() is None
        assert not rig.elector.is_ready_leader()


# --- stepping down: publish first, release second, then campaign again ------------------------------


def _fire_loss(rig: Rig) -> None:
    rig.backend.fire_loss("connection dropped")


def _step_down(rig: Rig) -> None:
    rig.elector.request_step_down("operator asked")


@pytest.mark.parametrize(
    ("renew", "action", "reason", "trace"),
    [
        pytest.param(
            [LOST], None, "stepped down: lost the lock: another candidate holds it",
            ["0 acquire", "0 publish leader#7", "2 renew 7", "2 publish standby", "2 release 7", "4 acquire"],
            id="renew returns None",
        ),
        pytest.param(
            [down() for _ in range(8)], None, "stepped down: no successful renewal within renew_deadline (4s)",
            ["0 acquire", "0 publish leader#7", *[f"{2 + i / 4:g} renew 7" for i in range(8)],
             "4 publish standby", "4 release 7", "6 acquire"],
            id="renew deadline passes",
        ),
        pytest.param(
            [], _fire_loss, "stepped down: lock lost: connection dropped",
            ["0 acquire", "0 publish leader#7", "1 loss connection dropped", "1 publish standby", "1 release 7",
             "3 acquire"],
            id="loss callback",
        ),
        pytest.param(
            [], _step_down, "stepped down: operator asked",
            ["0 acquire", "0 publish leader#7", "1 publish draining#7", "1 publish standby", "1 release 7",
             "7 acquire"],
            id="step-down request drains, then waits a lease duration",
        ),
    ],
)
async def test_step_down_publishes_before_release_then_campaigns(
    renew: list[Any], action: Callable[[Rig], None] | None, reason: str, trace: list[str]
) -> None:
    rig = Rig(acquire=[Win(7), BLOCK], renew=renew, release=[OK])
    async with rig.running():
        if action is not None:
            await rig.until(1)
            action(rig)
        await rig.until_trace(trace[-1])
        assert rig.trace() == trace
        status = rig.elector.status
        assert status.role is Role.STANDBY
        assert status.reason == reason
        assert (status.term, status.leader, status.leader_token, status.leader_since) == (None, None, None, None)
        assert status.transitions == (3 if action is _step_down else 2)
        assert rig.elector.acting_term() is None
        assert rig.backend.ops("release")[0].timeout == RELEASE_TIMEOUT
        assert rig.backend.ops("release")[0].term.token == 7  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("renew", "renew_times", "step_down_at"),
    [
        pytest.param([down() for _ in range(8)], [2 + i / 4 for i in range(8)], 4, id="failing fast"),
        pytest.param([Hang(then=down())], [2], 4, id="hanging until its timeout"),
        pytest.param([down(), down(), Hang(then=down())], [2, 2.25, 2.5], 4, id="failing, then hanging"),
        pytest.param([Delay(1.9, then=down())], [2], 4, id="slow failure: the retry would fall after the deadline"),
    ],
)
async def test_renew_unavailable_retried_until_deadline_then_step_down(
    renew: list[Any], renew_times: list[float], step_down_at: float
) -> None:
    rig = Rig(acquire=[Win(7), BLOCK], renew=renew, release=[OK])
    async with rig.running():
        await rig.until(step_down_at - 0.125)
        assert rig.elector.is_ready_leader()
        await rig.until_trace(f"{step_down_at:g} release 7")
        assert [t - T0 for t in rig.backend.times("renew")] == renew_times
        assert rig.trace()[-2:] == [f"{step_down_at:g} publish standby", f"{step_down_at:g} release 7"]
        stepped = next(s for s in rig.statuses if s.role is Role.STANDBY)
        assert "no successful renewal within renew_deadline" in stepped.reason
        # Each attempt may use what is left of the deadline, and no more.
        assert [c.timeout for c in rig.backend.ops("renew")] == [
            pytest.approx(T0 + 4 - c.at) for c in rig.backend.ops("renew")]
        assert all(not ok for _, ok in rig.renewals) and len(rig.renewals) == len(renew_times)


@pytest.mark.parametrize(
    ("renew", "renew_times"),
    [
        pytest.param([down(), RENEWED], [2, 2.25, 4.25], id="one failure"),
        pytest.param([down(), down(), down(), RENEWED], [2, 2.25, 2.5, 2.75, 4.75], id="three failures"),
        pytest.param([*(down() for _ in range(7)), RENEWED], [*(2 + i / 4 for i in range(8)), 5.75],
                     id="success at the last attempt before the deadline"),
    ],
)
async def test_renew_failure_then_success_keeps_leading(renew: list[Any], renew_times: list[float]) -> None:
    rig = Rig(acquire=[Win(7)], renew=[*renew, BLOCK])
    async with rig.running():
        await rig.until_trace(f"{renew_times[-1]:g} renew 7")
        assert [t - T0 for t in rig.backend.times("renew")] == renew_times
        assert [s.role for s in rig.statuses] == [Role.LEADER]
        assert rig.elector.is_ready_leader()
        assert rig.elector.acting_term().written_at == T0 + renew_times[-2]  # type: ignore[union-attr]
        assert [ok for _, ok in rig.renewals] == [False] * (len(renew) - 1) + [True]


# --- loss and pauses: acting_term() answers from the clock, at once ----------------------------------


def hook_forever(rig: Rig) -> Callable[[bool], Awaitable[None]]:
    async def hook(_final: bool) -> None:
        rig.note("hook", "start")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            rig.note("hook", "cancelled")
            raise

    return hook


def hook_sleeping(seconds: float, *, fails: bool = False) -> Callable[[Rig], Callable[[bool], Awaitable[None]]]:
    def build(rig: Rig) -> Callable[[bool], Awaitable[None]]:
        async def hook(_final: bool) -> None:
            rig.note("hook", "start")
            try:
                await rig.clock.sleep(seconds)
            except asyncio.CancelledError:
                rig.note("hook", "cancelled")
                raise
            if fails:
                rig.note("hook", "fails")
                raise RuntimeError("app refused to drain")
            rig.note("hook", "done")

        return hook

    return build


@pytest.mark.parametrize("draining", [pytest.param(False, id="leader"), pytest.param(True, id="draining")])
async def test_loss_callback_stops_acting_at_once(draining: bool) -> None:
    rig = Rig(acquire=[Win(7), BLOCK], release=[OK], drain_hook=hook_forever)
    async with rig.running() as task:
        await rig.until(1)
        if draining:
            rig.elector.request_drain()
            await rig.until_trace("1 hook start")
            assert rig.elector.status.role is Role.DRAINING
        assert rig.elector.acting_term() is not None
        rig.backend.fire_loss("connection dropped")
        # Synchronously: before the loop has run again, and with the role not yet published.
        assert rig.elector.acting_term() is None
        assert not rig.elector.is_ready_leader()
        assert rig.elector.status.role is (Role.DRAINING if draining else Role.LEADER)
        await rig.until_trace("1 release 7")
        if draining:
            await settle(task.done)
            # Forced while draining: the final role at once, then the hook is cancelled, then release.
            assert rig.trace()[-4:] == ["1 loss connection dropped", "1 publish released", "1 hook cancelled",
                                        "1 release 7"]
        else:
            assert rig.trace()[-3:] == ["1 loss connection dropped", "1 publish standby", "1 release 7"]


async def test_loss_callback_ignored_while_standby() -> None:
    rig = Rig(acquire=[Held(OTHER, 3), Win(4)], renew=[BLOCK])
    async with rig.running():
        await rig.until(1)
        rig.backend.fire_loss("connection dropped")
        await settle(lambda: leading(rig))
        assert rig.now == 2
        await rig.until(3)
        assert rig.elector.is_ready_leader()
        assert rig.elector.status.reason == "acquired the lock"


@pytest.mark.parametrize(
    ("pause", "acting_after"),
    [
        pytest.param(3.875, True, id="paused until just before the deadline"),
        pytest.param(4.0, False, id="paused until exactly the deadline"),
        pytest.param(30.0, False, id="paused far past the lease"),
    ],
)
async def test_paused_process_stops_acting_before_the_loop_runs(pause: float, acting_after: bool) -> None:
    rig = Rig(acquire=[Win(7), BLOCK], renew=[RENEWED, BLOCK] if acting_after else [], release=[OK])
    async with rig.running():
        await rig.until(1)
        assert rig.elector.is_ready_leader()
        rig.clock.advance(pause - 1)  # the process was frozen: no task ran meanwhile
        assert (rig.elector.acting_term() is not None) is acting_after
        assert rig.elector.is_ready_leader() is acting_after
        assert rig.elector.status.role is Role.LEADER  # not yet published: nothing has run
        if acting_after:
            # Woken late, the loop renews at once and goes on leading.
            await rig.until_trace(f"{pause:g} renew 7")
            await settle(lambda: rig.elector.acting_term() is not None
                         and rig.elector.acting_term().written_at == T0 + pause)  # type: ignore[union-attr]
            assert rig.elector.is_ready_leader()
        else:
            # Woken past the deadline, it steps down without trying to renew.
            await rig.until_trace(f"{pause:g} release 7")
            assert rig.trace() == ["0 acquire", "0 publish leader#7", f"{pause:g} publish standby",
                                   f"{pause:g} release 7"]


async def test_deadline_passing_while_draining_steps_down_and_cancels_the_hook() -> None:
    rig = Rig(acquire=[Win(7)], renew=[down() for _ in range(8)], release=[OK], drain_hook=hook_forever)
    async with rig.running() as task:
        await rig.until(1)
        rig.elector.request_drain()
        await settle(task.done)
        assert rig.trace()[-4:] == ["3.75 renew 7", "4 publish released", "4 hook cancelled", "4 release 7"]
        assert [s.role for s in rig.statuses] == [Role.LEADER, Role.DRAINING, Role.RELEASED]


async def test_acting_term_none_past_deadline_while_a_renewal_overruns() -> None:
    """A backend breaking its timeout promise cannot stretch the term: the clock decides."""
    rig = Rig(acquire=[Win(7), BLOCK], renew=[Hang(extra=1.0, then=down())], release=[OK])
    async with rig.running():
        await rig.until(3.875)
        assert rig.elector.is_ready_leader()
        await rig.until(4.0)
        assert rig.elector.acting_term() is None
        assert rig.elector.status.role is Role.LEADER  # still inside the renew call
        await rig.until_trace("5 release 7")
        assert rig.trace()[-2:] == ["5 publish standby", "5 release 7"]


# --- draining -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hook", "drain_timeout", "trace"),
    [
        pytest.param(None, 30.0, ["1 publish draining#7", "1 publish released", "1 release 7"], id="no hook"),
        pytest.param(hook_sleeping(0.5), 30.0,
                     ["1 publish draining#7", "1 hook start", "1.5 hook done", "1.5 publish released",
                      "1.5 release 7"],
                     id="quick hook"),
        pytest.param(hook_sleeping(8.5), 30.0,
                     ["1 publish draining#7", "1 hook start", "2 renew 7", "4 renew 7", "6 renew 7", "8 renew 7",
                      "9.5 hook done", "9.5 publish released", "9.5 release 7"],
                     id="long hook: renewals continue"),
        pytest.param(hook_sleeping(0.5, fails=True), 30.0,
                     ["1 publish draining#7", "1 hook start", "1.5 hook fails", "1.5 publish released",
                      "1.5 release 7"],
                     id="hook fails: release anyway"),
        pytest.param(hook_forever, 4.5,
                     ["1 publish draining#7", "1 hook start", "2 renew 7", "4 renew 7", "5.5 hook cancelled",
                      "5.5 publish released", "5.5 release 7"],
                     id="hook never finishes: release at drain_timeout"),
        pytest.param(hook_sleeping(20.0), 4.5,
                     ["1 publish draining#7", "1 hook start", "2 renew 7", "4 renew 7", "5.5 hook cancelled",
                      "5.5 publish released", "5.5 release 7"],
                     id="hook outlasts drain_timeout"),
        pytest.param(hook_forever, 0.0,
                     ["1 publish draining#7", "1 hook start", "1 hook cancelled", "1 publish released",
                      "1 release 7"],
                     id="zero drain_timeout"),
    ],
)
async def test_drain_as_leader(hook: Callable[[Rig], Callable[[bool], Awaitable[None]]] | None,
                               drain_timeout: float, trace: list[str]) -> None:
    renewals = sum(" renew " in line for line in trace)
    rig = Rig(acquire=[Win(7)], renew=[RENEWED] * renewals, release=[OK], drain_hook=hook,
              drain_timeout=drain_timeout)
    async with rig.running() as task:
        await rig.until(1)
        rig.elector.request_drain()
        rig.elector.request_drain()  # idempotent
        assert rig.elector.status.role is Role.LEADER  # the loop publishes DRAINING
        await settle(lambda: rig.elector.status.role is not Role.LEADER)
        status = rig.elector.status
        assert (status.role, status.token, status.leader, status.leader_token) == (Role.DRAINING, 7, ME, 7)
        assert status.leader_since == WALL0 + T0  # still the term's start
        assert rig.elector.acting_term() is not None  # may finish its in-flight work...
        assert not rig.elector.is_ready_leader()  # ...but takes no new work
        await settle(task.done)
        assert task.result() is None
        await asyncio.wait_for(rig.elector.wait_released(), 1.0)
        assert rig.trace() == ["0 acquire", "0 publish leader#7", *trace]
        assert [s.role for s in rig.statuses] == [Role.LEADER, Role.DRAINING, Role.RELEASED]
        assert rig.elector.status.transitions == 3
        assert rig.elector.acting_term() is None


@pytest.mark.parametrize(
    ("acquire", "drain_at", "trace"),
    [
        pytest.param([], None, ["0 publish released"], id="before run"),
        pytest.param([Held(OTHER, 3)], 1,
                     ["0 acquire", "2 publish standby", "2 publish released"],
                     id="while acquire waits: no new acquire"),
        pytest.param([down()], 1,
                     ["0 acquire", "0 publish standby", "1 publish released"],
                     id="while waiting to retry an unavailable store"),
    ],
)
async def test_drain_while_standby(acquire: list[Any], drain_at: float | None, trace: list[str]) -> None:
    rig = Rig(acquire=acquire)
    if drain_at is None:
        rig.elector.request_drain()
    async with rig.running() as task:
        if drain_at is not None:
            await rig.until(drain_at)
            rig.elector.request_drain()
        await settle(task.done)
        assert rig.trace() == trace
        assert rig.elector.status.role is Role.RELEASED
        assert all(s.role is not Role.LEADER for s in rig.statuses)
        assert rig.backend.ops("release") == []


async def test_drain_while_waiting_after_step_down() -> None:
    rig = Rig(acquire=[Win(7)], renew=[LOST], release=[OK])
    async with rig.running() as task:
        await rig.until_trace("2 release 7")
        await rig.until(3)
        rig.elector.request_drain()
        await settle(task.done)
        assert rig.trace()[-3:] == ["2 publish standby", "2 release 7", "3 publish released"]


async def test_term_acquired_while_draining_is_released_at_once() -> None:
    rig: Rig

    def acquire_while_drain_arrives(_call: object) -> Win:
        rig.elector.request_drain()
        return Win(9)

    rig = Rig(acquire=[acquire_while_drain_arrives], release=[OK])
    async with rig.running() as task:
        await settle(task.done)
        assert rig.trace() == ["0 acquire", "0 release 9", "0 publish released"]
        assert [s.role for s in rig.statuses] == [Role.RELEASED]
        assert all(s.term is None and s.leader is None for s in rig.statuses)


# --- standby: store errors and other holders ---------------------------------------------------------


@pytest.mark.parametrize("timings", [pytest.param(DEFAULT, id="default"), pytest.param(FAST, id="fast")])
async def test_acquire_unavailable_keeps_standby_and_retries_after_retry_period(timings: Timings) -> None:
    rig = Rig(timings=timings, acquire=[down("connection refused"), down("connection refused"),
                                        down("timeout"), BLOCK])
    async with rig.running():
        await settle(lambda: len(rig.backend.ops("acquire")) == 4)
        period = timings.retry_period
        assert [t - T0 for t in rig.backend.times("acquire")] == [0, period, 2 * period, 3 * period]
        assert [c.timeout for c in rig.backend.ops("acquire")] == [period] * 4
        # Published once per distinct reason.
        assert [(s.role, s.reason) for s in rig.statuses] == [
            (Role.STANDBY, "lock store unavailable: connection refused"),
            (Role.STANDBY, "lock store unavailable: timeout"),
        ]
        assert rig.elector.status.transitions == 0
        assert rig.elector.acting_term() is None


@pytest.mark.parametrize(
    ("acquire", "published"),
    [
        pytest.param([Held(OTHER, 3)], [(OTHER, 3, "standing by")], id="another holder"),
        pytest.param([Held(OTHER, 3), Held(OTHER, 3)], [(OTHER, 3, "standing by")], id="same holder: no republish"),
        pytest.param([Held(OTHER, 3), Held(THIRD, 4), Held(None, None)],
                     [(OTHER, 3, "standing by"), (THIRD, 4, "standing by"), (None, None, "standing by")],
                     id="new holder, then free"),
        pytest.param([Held(OTHER, 3), down()],
                     [(OTHER, 3, "standing by"), (OTHER, 3, "lock store unavailable: connection refused")],
                     id="store down: last known leader kept"),
        pytest.param([Held(OTHER, 3, wait=False)], [(OTHER, 3, "standing by")], id="race lost at once"),
    ],
)
async def test_observed_holder_is_published(acquire: list[Any], published: list[tuple[Any, ...]]) -> None:
    rig = Rig(acquire=[*acquire, BLOCK])
    async with rig.running():
        await settle(lambda: len(rig.backend.ops("acquire")) == len(acquire) + 1)
        assert [(s.leader, s.leader_token, s.reason) for s in rig.statuses] == published
        assert all(s.role is Role.STANDBY and s.term is None and s.leader_since is None for s in rig.statuses)
        assert rig.elector.acting_term() is None


async def test_step_down_request_while_standby_is_a_no_op() -> None:
    rig = Rig(acquire=[Held(OTHER, 3), Win(4)], renew=[BLOCK])
    async with rig.running():
        await rig.until(1)
        rig.elector.request_step_down("operator asked")
        await settle(lambda: leading(rig))
        await rig.until(3)
        assert rig.elector.is_ready_leader()
        assert rig.backend.ops("release") == []


async def test_cancel_while_leading_publishes_before_release() -> None:
    rig = Rig(acquire=[Win(7)], renew=[BLOCK], release=[OK])
    async with rig.running() as task:
        await rig.until_trace("2 renew 7")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rig.trace() == ["0 acquire", "0 publish leader#7", "2 renew 7", "2 publish standby", "2 release 7",
                               "2 publish released"]
        assert rig.statuses[1].reason == "stopped while leading"
        assert rig.elector.acting_term() is None


async def test_release_failure_is_tolerated() -> None:
    rig = Rig(acquire=[Win(7), Held(OTHER, 8), BLOCK], renew=[LOST], release=[down("connection reset")])
    async with rig.running():
        await settle(lambda: len(rig.backend.ops("acquire")) == 3)
        assert rig.trace() == ["0 acquire", "0 publish leader#7", "2 renew 7", "2 publish standby", "2 release 7",
                               "4 acquire", "6 publish standby", "6 acquire"]
        assert (rig.elector.status.leader, rig.elector.status.leader_token) == (OTHER, 8)


async def test_failing_listener_does_not_stop_the_others() -> None:
    rig = Rig(acquire=[Win(7)], renew=[BLOCK])
    seen: list[Role] = []

    def broken(_status: ElectionStatus) -> None:
        raise RuntimeError("listener bug")

    rig.elector.add_listener(broken)
    rig.elector.add_listener(lambda status: seen.append(status.role))
    async with rig.running():
        await settle(lambda: leading(rig))
        assert seen == [Role.LEADER]
        assert rig.elector.is_ready_leader()


# --- whole histories: tokens and transitions -----------------------------------------------------------


async def test_tokens_seen_by_listeners_strictly_increase() -> None:
    rig = Rig(
        acquire=[Held(OTHER, 1), Win(2), Held(OTHER, 3), Held(THIRD, 5), Win(6), Held(None, None), Win(8)],
        renew=[RENEWED, LOST, down(), LOST, RENEWED, BLOCK],
        release=[OK, OK],
    )
    async with rig.running():
        await settle(lambda: len(rig.backend.ops("renew")) == 6)
        tokens: list[int] = []
        for status in rig.statuses:
            for token in (status.leader_token, status.token):
                if token is not None and (not tokens or tokens[-1] != token):
                    tokens.append(token)
        assert tokens == [1, 2, 3, 5, 6, 8]
        assert all(a < b for a, b in itertools.pairwise(tokens))
        own = [s.token for s in rig.statuses if s.role is Role.LEADER]
        assert own == [2, 6, 8]
        assert all(s.leader_token == s.token for s in rig.statuses if s.role is Role.LEADER)


async def test_transitions_count_role_changes_only() -> None:
    rig = Rig(acquire=[Held(OTHER, 1), Win(2), Held(OTHER, 3), Win(4)], renew=[LOST, RENEWED],
              release=[OK, OK], drain_hook=hook_sleeping(2.5))
    async with rig.running() as task:
        await settle(lambda: rig.elector.status.token == 4)
        await rig.until(rig.now + 1)
        rig.elector.request_drain()
        await settle(task.done)
        roles = [s.role for s in rig.statuses]
        assert roles == [Role.STANDBY, Role.LEADER, Role.STANDBY, Role.STANDBY, Role.LEADER, Role.DRAINING,
                         Role.RELEASED]
        changes = 0
        previous = Role.STANDBY
        for status in rig.statuses:
            changes += status.role != previous
            previous = status.role
            assert status.transitions == changes
        assert rig.elector.status.transitions == 5


async def test_on_renew_observes_duration_and_outcome() -> None:
    rig = Rig(acquire=[Win(7), BLOCK], renew=[Renewed(write_time=0.5), down(), Hang(then=LOST)], release=[OK])
    async with rig.running():
        await rig.until_trace("6 release 7")
        assert rig.renewals == [(0.5, True), (0.0, False), (1.75, False)]
        assert rig.trace()[-2:] == ["6 publish standby", "6 release 7"]


async def test_term_is_what_the_fake_backend_wrote() -> None:
    """Guards the fake: written_at comes from the clock just before the write."""
    clock = FakeClock(T0)
    backend = FakeBackend(clock, acquire=[Win(3, write_time=1.0)], renew=[Renewed(write_time=1.0)])
    term = await backend.acquire(ME, timeout=2.0)
    assert isinstance(term, Term)
    renewed = await backend.renew(term, timeout=2.0)
    assert (term.token, term.written_at) == (3, T0)
    assert renewed is not None and (renewed.token, renewed.written_at) == (3, T0 + 1.0)
    assert renewed.version != term.version
    assert clock.now == T0 + 2.0


# --- holds (planned handover to another candidate) ------------------------------------------------


async def test_a_hold_stops_campaigning_until_it_ends() -> None:
    rig = Rig(acquire=[Held(OTHER, 3), Win(4)], renew=[BLOCK])
    async with rig.running():
        await rig.until(1)
        rig.elector.request_hold(10)
        await rig.until(9)
        assert not leading(rig)
        assert "holding off" in rig.elector.status.reason
        calls_during_hold = len(rig.backend.ops("acquire"))
        await settle(lambda: leading(rig))
        assert rig.now >= 11
        assert calls_during_hold == 1  # the attempt in flight was abandoned, no new one started


async def test_a_hold_abandons_the_attempt_in_flight() -> None:
    rig = Rig(acquire=[Hang(then=Win(5)), Win(6)], renew=[BLOCK], release=[OK])
    async with rig.running():
        await rig.until(0.1)
        rig.elector.request_hold(3)
        await rig.until(2.5)
        assert not leading(rig)
        await settle(lambda: leading(rig))
        assert rig.elector.status.token == 6


async def test_a_zero_hold_ends_a_hold_early() -> None:
    rig = Rig(acquire=[Held(OTHER, 3), Win(4)], renew=[BLOCK])
    async with rig.running():
        await rig.until(1)
        rig.elector.request_hold(60)
        await rig.until(5)
        assert not leading(rig)
        rig.elector.request_hold(0)
        await settle(lambda: leading(rig))
        assert rig.now < 8


# --- the end of a term: publish, stop the app, release -----------------------------------------------


def stop_taking(seconds: float) -> Callable[[Rig], Callable[[bool], Awaitable[None]]]:
    """A gate whose app takes ``seconds`` to stop."""
    def build(rig: Rig) -> Callable[[bool], Awaitable[None]]:
        async def stop(urgent: bool) -> None:
            rig.note("stop", "urgent" if urgent else "start")
            await rig.clock.sleep(seconds)
            rig.note("stop", "done")

        return stop

    return build


S = DEFAULT  # 6 / 4 / 2


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        pytest.param(LeadState(now=1, deadline=4), Decision(Action.LEAD), id="inside the deadline: lead"),
        pytest.param(LeadState(now=4, deadline=4), Decision(
            Action.FINISH, "stepped down: no successful renewal within renew_deadline (4s)", Role.STANDBY, 2.0),
            id="deadline reached: finish at once"),
        pytest.param(LeadState(now=1, deadline=4, lost_reason="lock lost: x"), Decision(
            Action.FINISH, "stepped down: lock lost: x", Role.STANDBY, 2.0, urgent=True),
            id="lost: finish at once, kill at once"),
        pytest.param(LeadState(now=1, deadline=4, step_down_reason="asked"),
                     Decision(Action.DRAIN, "stepping down: asked"), id="step-down: drain first"),
        pytest.param(LeadState(now=1, deadline=4, drain_requested=True),
                     Decision(Action.DRAIN, "draining: finishing in-flight work"), id="drain: drain first"),
        pytest.param(LeadState(now=1, deadline=4, step_down_reason="asked", draining=True),
                     Decision(Action.LEAD), id="draining, app not stopped yet: keep renewing"),
        pytest.param(LeadState(now=1, deadline=4, step_down_reason="asked", draining=True, drain_done=True),
                     Decision(Action.FINISH, "stepped down: asked", Role.STANDBY, 6.0),
                     id="step-down drained: finish, then stand aside a lease duration"),
        pytest.param(LeadState(now=1, deadline=4, drain_requested=True, draining=True, drain_done=True),
                     Decision(Action.FINISH, "released: no longer campaigning", Role.RELEASED),
                     id="drained: finish as released"),
        pytest.param(LeadState(now=1, deadline=4, step_down_reason="asked", drain_requested=True, draining=True,
                               drain_done=True),
                     Decision(Action.FINISH, "released: no longer campaigning", Role.RELEASED),
                     id="drain requested during a step-down: released"),
        pytest.param(LeadState(now=5, deadline=4, drain_requested=True, draining=True),
                     Decision(Action.FINISH, "stepped down: no successful renewal within renew_deadline (4s)",
                              Role.RELEASED, 2.0),
                     id="deadline while draining: forced, released"),
        pytest.param(LeadState(now=1, deadline=4, lost_reason="lock lost: x", step_down_reason="asked",
                               draining=True),
                     Decision(Action.FINISH, "stepped down: lock lost: x", Role.STANDBY, 2.0, urgent=True),
                     id="loss while stepping down: forced"),
    ],
)
def test_decide(state: LeadState, expected: Decision) -> None:
    assert decide(state, S) == expected


def _request_drain(rig: Rig) -> None:
    rig.elector.request_drain()


@pytest.mark.parametrize(
    ("renew", "action", "drain_timeout", "tail"),
    [
        pytest.param([], _step_down, 30.0,
                     ["1 publish draining#7", "1 hook start", "1.5 hook done", "1.5 publish standby", "1.5 stop start",
                      "2.3 stop done", "2.3 release 7"], id="step-down"),
        pytest.param([], _request_drain, 30.0,
                     ["1 publish draining#7", "1 hook start", "1.5 hook done", "1.5 publish released",
                      "1.5 stop start", "2.3 stop done", "2.3 release 7"], id="drain"),
        pytest.param([RENEWED], _step_down, 1.25,
                     ["1 publish draining#7", "1 hook start", "2 renew 7", "2.25 hook cancelled",
                      "2.25 publish standby", "2.25 stop start", "3.05 stop done", "3.05 release 7"],
                     id="drain timeout"),
        pytest.param([down() for _ in range(8)], None, 30.0,
                     ["3.75 renew 7", "4 publish standby", "4 stop start", "4.8 stop done", "4.8 release 7"],
                     id="renew deadline"),
        pytest.param([LOST], None, 30.0,
                     ["2 renew 7", "2 publish standby", "2 stop urgent", "2.8 stop done", "2.8 release 7"],
                     id="another holder"),
        pytest.param([], _fire_loss, 30.0,
                     ["1 loss connection dropped", "1 publish standby", "1 stop urgent", "1.8 stop done",
                      "1.8 release 7"], id="lock lost: the app is killed at once"),
    ],
)
async def test_every_ending_releases_only_after_the_app_stopped(
    renew: list[Any], action: Callable[[Rig], None] | None, drain_timeout: float, tail: list[str]
) -> None:
    rig = Rig(acquire=[Win(7), BLOCK], renew=[*renew, BLOCK] if action else renew, release=[OK],
              drain_hook=hook_sleeping(0.5) if drain_timeout > 2 else hook_forever, drain_timeout=drain_timeout,
              stop_hook=stop_taking(0.8))
    async with rig.running():
        if action is not None:
            await rig.until(1)
            action(rig)
        await rig.until_trace(tail[-1])
        assert rig.trace()[-len(tail):] == tail
        assert rig.elector.unconfirmed_stops == 0


async def test_cancel_while_leading_stops_the_app_before_release() -> None:
    rig = Rig(acquire=[Win(7)], renew=[BLOCK], release=[OK], stop_hook=stop_taking(0.25))
    async with rig.running() as task:
        await rig.until_trace("2 renew 7")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rig.trace()[-5:] == ["2 publish standby", "2 stop start", "2.25 stop done", "2.25 release 7",
                                    "2.25 publish released"]


async def test_an_app_not_confirmed_stopped_is_never_released() -> None:
    """Past the stop bound the lock is left to expire: a release would let another lead beside it."""
    rig = Rig(acquire=[Win(7), BLOCK], release=[], stop_hook=stop_taking(60), stop_timeout=1.5)
    async with rig.running():
        await rig.until(1)
        rig.elector.request_step_down("asked")
        await rig.until_trace("1 publish standby")
        await rig.until(2.75)
        assert rig.backend.ops("release") == []
        assert rig.elector.unconfirmed_stops == 1
        assert rig.elector.status.role is Role.STANDBY
        await rig.until_trace("8.5 acquire")  # campaigns again only once the lease has run out
        assert rig.backend.ops("release") == []


async def test_a_loss_while_the_acquisition_returns_is_never_acted_on() -> None:
    rig: Rig

    def win_then_lose(_call: object) -> Win:
        rig.backend.fire_loss("connection dropped")
        return Win(9)

    rig = Rig(acquire=[win_then_lose, BLOCK], release=[OK])
    async with rig.running():
        await rig.until_trace("0 release 9")
        assert all(s.role is not Role.LEADER for s in rig.statuses)
        assert rig.elector.status.reason == "stepped down: lock lost: connection dropped"


async def test_a_takeover_of_an_unreleased_term_waits_before_acting() -> None:
    rig = Rig(acquire=[Win(7, acting_in=3.0)], renew=[RENEWED, BLOCK], release=[OK])
    async with rig.running():
        await rig.until(2.5)
        assert rig.elector.acting_term() is None
        assert rig.elector.status.role is Role.STANDBY
        assert rig.elector.status.reason.startswith("taking over: the previous holder did not release")
        assert rig.trace() == ["0 acquire", "0 publish standby", "2 renew 7"]
        await settle(rig.elector.is_ready_leader)
        assert rig.now == 3.0


@pytest.mark.parametrize(("holder", "identity", "prefix", "expected"), [
    ("p/0a1b2c3d/old", "p/0a1b2c3d/new", "p/0a1b2c3d/", True),
    ("p/0a1b2c3d/new", "p/0a1b2c3d/new", "p/0a1b2c3d/", False),  # itself: not a predecessor
    ("p/0a1b2c3d/old", "p/0a1b2c3d/new", None, False),  # not the sole candidate in its pod
    ("q/0a1b2c3d/old", "p/0a1b2c3d/new", "p/0a1b2c3d/", False),  # another pod
    ("p/99999999/old", "p/0a1b2c3d/new", "p/0a1b2c3d/", False),  # a pod of that name before
    (None, "p/0a1b2c3d/new", "p/0a1b2c3d/", False),
    ("p/0a1b2c3d/old", "me", "p/0a1b2c3d/", False),  # an identity the sidecar did not make
])
def test_a_predecessor_is_an_earlier_incarnation_in_the_same_pod(
        holder: str | None, identity: str, prefix: str | None, expected: bool) -> None:
    assert is_predecessor(holder, identity, prefix) is expected


def test_every_incarnation_in_a_pod_begins_with_its_pod_prefix() -> None:
    prefix = pod_prefix("p", "0a1b2c3d-0000-1111-2222-333344445555")
    assert prefix == "p/0a1b2c3d/"
    assert make_identity(pod_name="p", pod_uid="0a1b2c3d-0000-1111-2222-333344445555", hostname="h",
                         pid=1).startswith(prefix)
